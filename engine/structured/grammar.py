"""GrammarCompiler and GrammarConstraint: structured outputs with llguidance.

Why llguidance (``benchmarks/grammar_backends.py`` on this 2-core CPU, SmolLM2's
49k-token vocabulary, a nested 5-field schema): a compile plus first mask takes
under 1 ms (xgrammar: 10-30 ms), one mask step costs ~0.2 ms at batch 1 and ~1 ms
at batch 8 (xgrammar: ~0.5 and ~3 ms), and it installs as one 3 MB wheel with no
further dependencies (xgrammar pulls triton, a 286 MB GPU compiler). vLLM ships
it as its ``guidance`` backend.

* :class:`GrammarCompiler` (one per tokenizer, thread-safe) turns a request's
  spec (a JSON schema, "any JSON object", or a tool-call grammar) into a
  validated :class:`CompiledGrammar`; results are cached by the spec's JSON with
  its key order kept (the order of ``properties`` is the order the fields are
  generated in, so two orders are two grammars), so a schema is validated once. A spec the library cannot compile raises
  ValueError carrying the library's message.
* :class:`GrammarConstraint` is one sequence's matcher state. The sampler calls
  :meth:`~GrammarConstraint.mask` with the raw logits before picking a token and
  :meth:`~GrammarConstraint.accept` with the token it picked; :func:`mask_rows`
  does the same for a batch, one bitmask fill per constrained row. Only sampling
  changes: prompts, block hashes and prefix-cache hits are the same with or
  without a grammar.
* Object schemas are :func:`closed` (no undeclared keys unless the schema allows
  them), as OpenAI's strict structured outputs are.
* When the grammar is complete, only the EOS token stays allowed, so a
  constrained request ends with ``finish_reason: "stop"`` or hits its length.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import numpy as np
import torch

# Compact JSON (", " and ": ", no newlines): a small model cannot wander into endless whitespace.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
CACHE_SIZE = 256
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_KEYS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not",
                "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties")


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar (its serialized form)."""

    grammar: str


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def json_schema(self, schema: dict[str, Any]) -> CompiledGrammar:
        """Output must be JSON valid against ``schema`` (closed: see :func:`closed`)."""
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return self._compile("schema", closed(schema))

    def json_object(self) -> CompiledGrammar:
        """Output must be one JSON object (``response_format: {"type": "json_object"}``)."""
        return self._compile("schema", {"type": "object"})

    def tool_calls(self, tools: Sequence[tuple[str, dict[str, Any]]], *, open_tag: str,
                   close_tag: str, several: bool) -> CompiledGrammar:
        """Output must be ``open_tag {"name": N, "arguments": A} close_tag`` for one of
        ``tools`` (name, parameters schema), A valid against N's schema; ``several``
        allows more calls, one per line."""
        variants = [{"type": "object", "additionalProperties": False,
                     "required": ["name", "arguments"],
                     "properties": {"name": {"const": name}, "arguments": closed(params)}}
                    for name, params in tools]
        schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
        return self._compile("tool_calls", {"schema": schema, "open": open_tag, "close": close_tag,
                                            "several": several})

    def constraint(self, compiled: CompiledGrammar) -> GrammarConstraint:
        """A fresh matcher at the start of ``compiled``."""
        matcher = llguidance.LLMatcher(self._lltok, compiled.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GrammarConstraint(matcher, self.vocab_size)

    # ----------------------------------------------------------------- private
    def _compile(self, kind: str, spec: dict[str, Any]) -> CompiledGrammar:
        key = kind + ":" + json.dumps(spec, separators=(",", ":"))  # key order is meaning: not sorted
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self._grammar(kind, spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._lltok)
        if is_error:
            raise ValueError(messages[0] if messages else "the grammar does not compile")
        compiled = CompiledGrammar(grammar)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _grammar(kind: str, spec: dict[str, Any]) -> str:
        try:
            if kind == "schema":
                return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            schema = {**spec["schema"], "x-guidance": JSON_OPTIONS}
            call = f"{json.dumps(spec['open'])} body {json.dumps(spec['close'])}"
            start = "start: call (\"\\n\" call)*\n" if spec["several"] else "start: call\n"
            lark = f"{start}call: {call}\nbody: %json {json.dumps(schema)}\n"
            return llguidance.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as exc:
            raise ValueError(str(exc)) from exc


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that declares
    ``properties`` and says nothing about extra ones: OpenAI's strict mode requires it,
    pydantic omits it, and a small model otherwise invents keys until its token limit."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _SCHEMA_KEYS:
            out[key] = closed(value)
        else:  # const, enum, default, examples, ...: values, not schemas
            out[key] = value
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


class GrammarConstraint:
    """One sequence's position in a grammar; used only by the engine loop thread."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (1-D) with every token the grammar forbids set to -inf (a copy)."""
        out = logits.clone()
        mask_rows(out.unsqueeze(0), [self])
        return out

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token; raises ValueError if the grammar forbids it."""
        if not self._matcher.consume_token(token_id):
            raise ValueError(f"token {token_id} violates the grammar: {self._matcher.get_error()}")

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    def fork(self) -> GrammarConstraint:
        """An independent copy at the same position (one per choice of an n > 1 request)."""
        return GrammarConstraint(self._matcher.deep_copy(), self._bitmask.shape[1] * 32)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)


def mask_rows(logits: torch.Tensor, constraints: Sequence[GrammarConstraint | None]) -> None:
    """Mask a ``[batch, vocab]`` logits tensor in place, row i by ``constraints[i]`` (None: free)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    for j, i in enumerate(rows):
        constraint = constraints[i]
        assert constraint is not None
        constraint._fill(bitmask, j)
    # numpy unpacks the bits in a few microseconds, free of torch's thread pool.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    forbidden = torch.from_numpy(bits[:, :vocab] == 0)
    for j, i in enumerate(rows):
        logits[i].masked_fill_(forbidden[j], float("-inf"))
