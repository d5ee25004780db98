"""The engine's OpenAI-compatible HTTP server (Starlette), on top of ``LLMEngine``.

:mod:`~engine.server.app` builds the app and runs uvicorn; the handlers, request
validation, chat templates, images, response shapes, metrics and errors each have
their module here. Nothing in this package touches tensors.
"""
