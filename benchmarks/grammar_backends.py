"""llguidance vs xgrammar on this CPU: schema compile time and per-token mask cost.

For a nested JSON schema (a pydantic-style object with a string, an integer, an
enum, a nested object and an array) and the bundled SmolLM2 tokenizer (49,152
tokens), each library:

* builds its tokenizer description once (reported, not part of compile);
* compiles the schema and computes the first mask (median over ``--runs`` fresh
  compiles, no grammar cache; llguidance builds its lexer lazily, so the first
  mask is part of its compile);
* walks a valid instance token by token, and at each step computes the
  next-token bitmask for every sequence of a batch (1 and 8 matchers, each
  walking the same instance), applies it to float32 logits of shape
  ``[batch, vocab]`` and consumes the token. The per-step cost is the time
  of mask + apply for the whole batch, divided by the steps, after one untimed
  warm-up walk (torch's first masked_fill on a fresh tensor is slow).

xgrammar is optional (it pulls triton on install); point ``PYTHONPATH`` at a
``pip install --target DIR --no-deps xgrammar apache-tvm-ffi`` to include it.
Writes benchmarks/results/grammar_backends.json.

Usage: .venv/bin/python benchmarks/grammar_backends.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "grammar_backends.json"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
INSTANCE = ('{"name": "Ada Lovelace", "age": 36, "role": "admin", "address": '
            '{"city": "London", "zip": "W1"}, "tags": ["math", "engines", "poetry"]}')


def _llguidance(tokenizer: Any, tokens: list[int], runs: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    setup = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "})
    compiles = []
    for _ in range(runs):
        bitmask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        compiles.append(time.perf_counter() - t0)
        assert not matcher.is_error(), matcher.get_error()
    out = {"tokenizer_setup_s": setup, "compile_ms": 1000 * statistics.median(compiles)}
    def walk(batch: int) -> float:
        matchers = [llguidance.LLMatcher(lltok, grammar, log_level=0) for _ in range(batch)]
        bitmask = llguidance.torch.allocate_token_bitmask(batch, lltok.vocab_size)
        logits = torch.randn(batch, len(tokenizer))
        t0 = time.perf_counter()
        for tok in tokens:
            for i, m in enumerate(matchers):
                llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
            llguidance.torch.apply_token_bitmask_inplace(logits, bitmask)
            for m in matchers:
                assert m.consume_token(tok), m.get_error()
        return 1000 * (time.perf_counter() - t0) / len(tokens)

    walk(1), walk(8)  # warm-up
    for batch in (1, 8):
        out[f"mask_ms_per_step_batch{batch}"] = walk(batch)
    return out


def _xgrammar(tokenizer: Any, tokens: list[int], runs: int) -> dict[str, float] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    setup = time.perf_counter() - t0
    compiles = []
    for _ in range(runs):
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        compiles.append(time.perf_counter() - t0)
    out = {"tokenizer_setup_s": setup, "compile_ms": 1000 * statistics.median(compiles)}
    def walk(batch: int) -> float:
        matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
        bitmask = xgrammar.allocate_token_bitmask(batch, info.vocab_size)
        logits = torch.randn(batch, len(tokenizer))
        t0 = time.perf_counter()
        for tok in tokens:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
            xgrammar.apply_token_bitmask_inplace(logits, bitmask)
            for m in matchers:
                assert m.accept_token(tok)
        return 1000 * (time.perf_counter() - t0) / len(tokens)

    walk(1), walk(8)  # warm-up
    for batch in (1, 8):
        out[f"mask_ms_per_step_batch{batch}"] = walk(batch)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from engine.model_store import ensure_converted_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_converted_model()), local_files_only=True)
    tokens = [*tokenizer.encode(INSTANCE, add_special_tokens=False), tokenizer.eos_token_id]
    results = {"llguidance": _llguidance(tokenizer, tokens, args.runs),
               "xgrammar": _xgrammar(tokenizer, tokens, args.runs)}
    print(f"{'library':<12}{'setup s':>9}{'compile ms':>12}{'mask ms b1':>12}{'mask ms b8':>12}")
    for name, r in results.items():
        if r is None:
            print(f"{name:<12} (not installed)")
            continue
        print(f"{name:<12}{r['tokenizer_setup_s']:>9.2f}{r['compile_ms']:>12.2f}"
              f"{r['mask_ms_per_step_batch1']:>12.3f}{r['mask_ms_per_step_batch8']:>12.3f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "steps": len(tokens), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
