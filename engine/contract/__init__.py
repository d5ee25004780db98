"""What the engine, the gateway and the linter must agree on byte for byte, torch-free.

The gateway and the linter import these modules and nothing else of the engine but the
pure-Python block hashes of :mod:`engine.kvcache`: the limits (JSON depth, salt length,
block size; :mod:`~engine.contract.limits`), the OpenAI error type and its shape
(:mod:`~engine.contract.errors`), the bounded body reader and its caps
(:mod:`~engine.contract.body_reader`), the engine's API key (:mod:`~engine.contract.api_key`),
chat-template rendering (:mod:`~engine.contract.chat`, with its tool-call format, image
loading and pixel budget) over a torch-free tokenizer (:mod:`~engine.contract.chat_tokenizer`),
image identity (:mod:`~engine.contract.image_content`), SSE framing
(:mod:`~engine.contract.sse`), the Responses request translation
(:mod:`~engine.contract.responses_request`) and where a converted model lives
(:mod:`~engine.contract.model_location`). ``tests/engine/test_engine_layout.py`` proves
that importing them loads neither torch nor transformers.
"""
