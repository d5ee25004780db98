"""The engine's OpenAI-compatible HTTP server (Starlette), on top of ``LLMEngine``.

:mod:`~engine.server.app` builds the app and runs uvicorn; the handlers, request
validation, tool calls, structured outputs, response shapes and metrics each have
their module here. What the gateway and the linter share with it (errors, the body
reader, limits, chat templates, images, SSE framing, the Responses request
translation) is in :mod:`engine.contract`. Nothing in this package touches tensors.
"""
