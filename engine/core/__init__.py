"""The engine loop: requests, scheduling, sampling, detokenizing, and the ``LLMEngine`` API.

:class:`~engine.core.llm_engine.LLMEngine` is the public contract the HTTP server
(:mod:`engine.server`) and the benchmarks use: ``submit`` a
:class:`~engine.core.output_stream.GenerationRequest`, read ``StepOutput``s from its
:class:`~engine.core.output_stream.OutputStream`, ``abort``, ``stats``.
"""
