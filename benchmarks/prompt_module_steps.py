"""Prompt modules (issue 21): how long each engine step of one long segmented request takes.

A request whose KV is assembled from modules runs its copies, its ``cacheblend``
probe and its runs in steps of the engine loop; while a step runs, every other
request waits. This times every step of one reused request of ``--docs`` documents
(~260 tokens each, all modules encoded by an earlier request with the same modules
in another order), on the bundled model, in process: the longest step is what a
request of another tenant may wait behind it.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/prompt_module_steps.py [--docs 16] [--mode cacheblend]
Prints a line per request and writes benchmarks/results/prompt_module_steps.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prompt_modules as bench  # the documents and the chat template's parts

from engine.config import EngineConfig
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.promptcache.segments import RECOVERY_MODES, Recovery, Segment, SegmentedPrompt

RESULTS = Path(__file__).resolve().parent / "results" / "prompt_module_steps.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=16, help="modules in the prompt (~260 tokens each)")
    parser.add_argument("--mode", choices=RECOVERY_MODES, default="cacheblend")
    parser.add_argument("--rounds", type=int, default=3, help="reused requests timed (each another order)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    engine = LLMEngine.launch(EngineConfig(kv_cache_memory_gib=3.0, seed=0))
    tok = engine.tokenizer
    docs = bench.documents(tok, 16)
    head, tail = bench.template_parts(tok)

    def enc(text: str) -> tuple[int, ...]:
        return tuple(tok.encode(text, add_special_tokens=False))

    modules = [Segment(enc(docs[k % 16] + f"\n\n({k})\n\n"), f"m{k}") for k in range(args.docs)]
    steps: list[float] = []
    step = engine.step

    def timed() -> None:  # runs on the engine's loop thread
        start = time.perf_counter()
        step()
        if (took := time.perf_counter() - start) >= 1e-3:  # not a loop turn with nothing to do
            steps.append(took)

    engine.step = timed  # type: ignore[method-assign]

    def request(rid: str, order: list[int]) -> dict[str, object]:
        sp = SegmentedPrompt((Segment(enc(head)), *(modules[k] for k in order), Segment(enc("Question: what?" + tail))),
                             Recovery(mode=args.mode))
        engine.call(steps.clear)  # between steps: the earlier request's last step is counted there
        start = time.perf_counter()
        outs = engine.submit(GenerationRequest(rid, sp.token_ids, SamplingParams(max_tokens=1, temperature=0.0),
                                               segmented=sp)).result(timeout=3600)
        engine.call(lambda: None)  # the step that sent the last output has ended (and been timed)
        assert outs[-1].error is None, outs[-1].error
        return {"prompt_tokens": len(sp.token_ids), "ttft_ms": (time.perf_counter() - start) * 1e3,
                "cached": outs[-1].num_cached_tokens, "steps_ms": [round(s * 1e3, 1) for s in steps]}

    rows = []
    try:
        order = list(range(args.docs))
        request("encode", order)
        rng = random.Random(1)
        for i in range(args.rounds):
            rng.shuffle(order)
            row = request(f"reuse-{i}", order)
            rows.append(row)
            print(f"{args.mode}, {row['prompt_tokens']} tokens: TTFT {row['ttft_ms']:.0f} ms, {len(row['steps_ms'])} "
                  f"steps, longest {max(row['steps_ms']):.0f} ms; steps ms {row['steps_ms']}", flush=True)
    finally:
        engine.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "prompt_module_steps", "docs": args.docs, "mode": args.mode,
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
