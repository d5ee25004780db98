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
* llguidance's resource limits are set here, explicitly (:data:`LIMITS`), for
  validation and for every matcher. A grammar is checked before admission:
  :func:`~engine.structured.satisfiable.unsatisfiable` rejects schemas with no
  finite instance (an object that requires itself), and a probe matcher computes
  the first mask and the forced prefix, so over-limit schemas (a pattern of a
  million repetitions, a forced prefix that never ends) fail with ValueError at
  compile time (refusals are cached like grammars). A limit still reached mid-generation raises :class:`GrammarError`
  (the schema's fault, not the engine's: the server answers it as a client error).
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

from engine.structured.satisfiable import unsatisfiable

# Compact JSON (", " and ": ", no newlines): a small model cannot wander into endless whitespace.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
CACHE_SIZE = 256
# llguidance's parser and lexer limits, set here explicitly so an upgrade cannot move them
# unnoticed (the values are llguidance 1.9's defaults): per mask step at most ~15 ms of lexer
# and ~2.5 ms of parser work, a lexer of at most 250k states (~1-2 kB each), a grammar of at
# most 500k symbols. A request's schema over them is a 400 (probe at compile time) or, if first
# reached mid-generation, a GrammarError.
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
    step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
    verbose_errors=False)  # no parser-state dumps (with schema fragments) in error messages
PROBE_FORCED_TOKENS = 8  # forced tokens the admission probe consumes before its second mask
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_KEYS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not",
                "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties")


class GrammarError(ValueError):
    """The grammar failed mid-generation (a limit reached, a token it cannot take): the
    request's schema is at fault. The engine reports it as ``GrammarError: <message>``
    (``engine.server.structured_output.GRAMMAR_ERROR_PREFIX``)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated llguidance grammar (its serialized form)."""

    grammar: str


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._cache: OrderedDict[str, CompiledGrammar | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def json_schema(self, schema: dict[str, Any]) -> CompiledGrammar:
        """Output must be JSON valid against ``schema`` (closed: see :func:`closed`)."""
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        reason = unsatisfiable(schema)
        if reason is not None:
            raise ValueError(f"the schema cannot be satisfied: {reason}")
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
        for name, params in tools:
            reason = unsatisfiable(params)
            if reason is not None:
                raise ValueError(f"the parameters of {name!r} cannot be satisfied: {reason}")
        schema = {"anyOf": variants} if len(variants) > 1 else variants[0]
        return self._compile("tool_calls", {"schema": schema, "open": open_tag, "close": close_tag,
                                            "several": several})

    def constraint(self, compiled: CompiledGrammar) -> GrammarConstraint:
        """A fresh matcher at the start of ``compiled``."""
        matcher = llguidance.LLMatcher(self._lltok, compiled.grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GrammarConstraint(matcher, self.vocab_size)

    # ----------------------------------------------------------------- private
    def _compile(self, kind: str, spec: dict[str, Any]) -> CompiledGrammar:
        """The grammar for ``spec``; a refusal is cached too (as its message), so a schema
        over the limits costs its compile time once, not on every request."""
        key = kind + ":" + json.dumps(spec, separators=(",", ":"))  # key order is meaning: not sorted
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self._check(self._grammar(kind, spec))
            except ValueError as exc:
                hit = str(exc)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def _check(self, grammar: str) -> CompiledGrammar:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._lltok, limits=LIMITS)
        if is_error:
            raise ValueError(_first_line(messages[0]) if messages else "the grammar does not compile")
        self._probe(grammar)
        return CompiledGrammar(grammar)

    def _probe(self, grammar: str) -> None:
        """Build a matcher and compute its first mask and forced prefix, where limits on
        the lexer (huge repetitions) and the parser (a forced prefix that never ends)
        show first; raise ValueError with llguidance's message if one is reached."""
        matcher = llguidance.LLMatcher(self._lltok, grammar, log_level=0, limits=LIMITS)
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        if not matcher.is_error():
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        if not matcher.is_error():
            forced = matcher.compute_ff_tokens()[:PROBE_FORCED_TOKENS]
            if forced and matcher.consume_tokens(forced):
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error():
            raise ValueError(_first_line(matcher.get_error()))

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
        """Advance past a sampled token; raises GrammarError if the grammar forbids it or
        a limit was reached (then the mask allowed nothing the grammar can continue with)."""
        if not self._matcher.consume_token(token_id):
            raise GrammarError(_first_line(self._matcher.get_error())
                               or f"token {token_id} violates the grammar")

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
    for i in rows:
        matcher = constraints[i]._matcher  # type: ignore[union-attr]
        if matcher.is_error():  # a limit reached while computing the mask
            raise GrammarError(_first_line(matcher.get_error()))
    # numpy unpacks the bits in a few microseconds, free of torch's thread pool.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    forbidden = torch.from_numpy(bits[:, :vocab] == 0)
    for j, i in enumerate(rows):
        logits[i].masked_fill_(forbidden[j], float("-inf"))


def _first_line(message: str) -> str:
    """llguidance's message without the parser-state dump that may follow it."""
    return message.split("\n<", 1)[0].strip()
