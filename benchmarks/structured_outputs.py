"""What grammar-constrained decoding costs: output tokens/s at 8 concurrent streams,
with and without a json_schema, on the bundled model, in one run.

Each round submits 8 requests at once (distinct chat prompts, temperature 1 with
fixed seeds, ``max_tokens`` 64) to one engine and measures output tokens over the
wall time until the last finishes; rounds alternate plain and constrained
(the same prompts and seeds), so machine noise hits both alike. Constrained
requests carry a grammar for a nested schema (the grammar is compiled once and
cached; each request gets its own matcher, as the server does). Reported:
median tokens/s of each kind, the ratio, and the issue's criterion (constrained
costs at most 15%). On a shared, loaded machine the end-to-end ratio is noisy, so
the time spent inside the grammar (mask + advance, timed around each call) is
also reported as a share of the constrained rounds' wall time: a direct bound on
what constrained decoding costs. Also counts how many constrained outputs that
finished on their own parse as JSON valid against the schema.

This is the json_schema variant of benchmarks/batching.py: the same batching
engine and 8 concurrent streams, but chat requests without ``ignore_eos`` (which a
grammar refuses, since the grammar decides where the output ends).

Writes benchmarks/results/structured_outputs.json.

Usage: .venv/bin/python benchmarks/structured_outputs.py [--rounds 4] [--streams 8] [--threads N]
"""

from __future__ import annotations

import argparse
import dataclasses
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

import jsonschema

from engine.config import EngineConfig
from engine.contract.chat import ChatRenderer
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.structured.grammar import GrammarCompiler

RESULTS = Path(__file__).resolve().parent / "results" / "structured_outputs.json"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "address": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}},
    "required": ["name", "age", "tags", "address"],
}
TOPICS = ["a baker", "a pilot", "a gardener", "a chess player", "a nurse", "a poet", "a cyclist",
          "a sailor", "a painter", "a teacher", "a farmer", "a drummer", "a chemist", "a tailor",
          "a judge", "a miner"]
MAX_TOKENS = 64


class TimedConstraint:
    """Delegates to a GrammarConstraint and adds the time of each call to ``spent``."""

    spent = 0.0

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def mask(self, logits: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.mask(logits)
        finally:
            TimedConstraint.spent += time.perf_counter() - t0

    def accept(self, token_id: int) -> None:
        t0 = time.perf_counter()
        try:
            self.inner.accept(token_id)
        finally:
            TimedConstraint.spent += time.perf_counter() - t0


def run_round(engine: LLMEngine, prompts: list[list[int]], compiler: GrammarCompiler | None,
              tag: str) -> tuple[float, float, list[tuple[str, str | None]]]:
    grammar = compiler.json_schema(SCHEMA) if compiler is not None else None
    streams = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        if compiler is not None and grammar is not None:
            params = dataclasses.replace(params,
                                         constraint=TimedConstraint(compiler.constraint(grammar)))
        streams.append(engine.submit(GenerationRequest(f"{tag}-{i}", prompt, params)))
    outputs = [s.result(timeout=900) for s in streams]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.new_token_ids) for out in outputs for o in out)
    texts = [("".join(o.new_text for o in out), out[-1].finish_reason) for out in outputs]
    return tokens / seconds, seconds, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory_gib=0.5, num_threads=args.threads,
                                                seed=0))
    engine.start()
    renderer = ChatRenderer(engine.tokenizer)
    prompts = [renderer.render([{"role": "user", "content": f"Describe {topic} as a JSON object."}]).token_ids
               for topic in TOPICS[: args.streams]]
    t0 = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    setup_s = time.perf_counter() - t0
    run_round(engine, prompts[:2], None, "warm")  # first forwards are slow
    rates: dict[str, list[float]] = {"plain": [], "json_schema": []}
    constrained_wall = 0.0
    valid = finished = 0
    try:
        for r in range(args.rounds):
            for kind in ("plain", "json_schema") if r % 2 == 0 else ("json_schema", "plain"):
                rate, seconds, texts = run_round(
                    engine, prompts, compiler if kind == "json_schema" else None, f"{kind}-{r}")
                rates[kind].append(rate)
                if kind == "json_schema":
                    constrained_wall += seconds
                print(f"round {r} {kind}: {rate:.1f} tok/s", flush=True)
                for text, reason in texts if kind == "json_schema" else []:
                    if reason == "stop":
                        finished += 1
                        try:
                            jsonschema.validate(json.loads(text), SCHEMA)
                            valid += 1
                        except (ValueError, jsonschema.ValidationError):
                            pass
    finally:
        engine.shutdown()
    plain, constrained = statistics.median(rates["plain"]), statistics.median(rates["json_schema"])
    cost = 1 - constrained / plain
    grammar_share = TimedConstraint.spent / constrained_wall
    print(f"{'kind':<14}{'tok/s (median)':>16}  rounds")
    for kind, values in rates.items():
        print(f"{kind:<14}{statistics.median(values):>16.1f}  {' '.join(f'{v:.1f}' for v in values)}")
    print(f"end to end: constrained decoding costs {100 * cost:.1f}% of output tok/s at "
          f"{args.streams} streams (median of rounds; target <= 15%: "
          f"{'met' if cost <= 0.15 else 'NOT met'})")
    print(f"time inside the grammar: {TimedConstraint.spent:.2f} s = {100 * grammar_share:.2f}% of "
          f"the constrained rounds' wall time ({constrained_wall:.1f} s)")
    print(f"{valid}/{finished} constrained outputs that finished on their own are schema-valid; "
          f"tokenizer setup {setup_s:.2f} s")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "streams": args.streams,
        "max_tokens": MAX_TOKENS, "rates": rates, "plain_median": plain,
        "json_schema_median": constrained, "cost_fraction": cost, "target_met": cost <= 0.15,
        "grammar_seconds": TimedConstraint.spent, "constrained_wall_seconds": constrained_wall,
        "grammar_share_of_wall": grammar_share,
        "valid_finished": [valid, finished], "tokenizer_setup_s": setup_s,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
