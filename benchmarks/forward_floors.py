"""The engine's forward against the floors, interleaved in one process (no HTTP, no sampling).

Per round, back to back: a bare transformers forward of 1 token (no cache), the
engine runner's decode step of one sequence (1 token over 100 cached positions),
a bare forward of 20 tokens, and the runner over 20 new tokens after a 2,048-token
cached context (K/V read through the block table). Medians after 2 warm-up rounds;
prints the two ratios of the issue's targets (decode <= 1.3x, warm 2k <= 1.5x).

Usage: .venv/bin/python benchmarks/forward_floors.py [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model.runner import SequenceInput


def ms(f: Callable[[], object]) -> float:
    start = time.perf_counter()
    f()
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory_gib=0.3, seed=0, num_threads=args.threads))
    model, runner = engine.model, engine.runner  # the engine thread is not started: nothing else runs
    one, twenty = torch.tensor([[5]]), torch.randint(100, 1000, (1, 20))
    decode = [SequenceInput([5], 100, list(range(8)), True)]
    warm = [SequenceInput(twenty[0].tolist(), 2048, list(range(8, 8 + 130)), True)]
    kinds: dict[str, Callable[[], object]] = {
        "bare_1": lambda: model(one, logits_to_keep=1),
        "decode_step": lambda: runner.execute(decode),
        "bare_20": lambda: model(twenty, logits_to_keep=1),
        "warm_2k_20": lambda: runner.execute(warm),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    with torch.inference_mode():
        for i in range(args.rounds + 2):
            for name, f in kinds.items():
                t = ms(f)
                if i >= 2:
                    times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"threads={torch.get_num_threads()} dtype={engine.layout.dtype} load={os.getloadavg()[0]:.1f}; medians (ms): "
          + ", ".join(f"{k}={v:.1f}" for k, v in med.items()))
    print(f"decode step / bare 1 token = {med['decode_step'] / med['bare_1']:.2f}x (target <= 1.3x); "
          f"warm 2k / bare 20 tokens = {med['warm_2k_20'] / med['bare_20']:.2f}x (target <= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
