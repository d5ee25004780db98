"""The engine's per-step cost against the floors, interleaved in one process (no HTTP).

The issue's two targets, measured round by round, back to back, in one process:

* **decode**: a decode step with one running request vs a bare forward of one
  token. ``engine_decode`` is what a running request pays per token inside the
  engine: the median interval between its consecutive outputs (engine loop,
  scheduling, input preparation, forward, sampling, detokenizing, the hand-off to
  the consumer thread) over ``--tokens`` greedy tokens; ``runner_decode`` is the
  runner's forward alone (1 token over 100 cached positions).
* **warm 2k**: a request over a 2,048-token cached prefix plus 20 new tokens vs a
  bare forward of those 20 tokens. ``engine_warm_2k`` is submit to finished output
  (``max_tokens=1``: block hashing, scheduling, the prefix-cache hit, the forward
  over 20 tokens attending to 2,068 positions, sampling); ``runner_warm_2k`` the
  forward alone.

Floors (``bare_1``, ``bare_20``) are a stock transformers forward of the same model
(no cache, ``logits_to_keep=1``). The engine is started with ``LLMEngine.launch``
and the floors and runner forwards run on its loop thread (``LLMEngine.call``), so
one thread does all of torch's parallel work, as in ``prefixgate engine``: a
forward on another thread would start a second OpenMP pool and slow both. Every
kind runs once per round, in a rotating order, after ``--warmup`` rounds. Per kind: median, minimum and maximum wall time,
and the median process CPU time (all threads; with ``--threads 1`` the least
load-sensitive figure on a shared machine). The ratios are given from the medians
(the issue's measure, meaningful on a quiet machine), the minimums and the CPU
medians; the load average is printed before and after. Writes
benchmarks/results/forward_floors.json.

Usage: .venv/bin/python benchmarks/forward_floors.py [--threads N] [--rounds 15]
       [--dtype auto|bfloat16|float32] [--tokens 16]
Example: .venv/bin/python benchmarks/forward_floors.py --rounds 21
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
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
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model.runner import SequenceInput

RESULTS = Path(__file__).resolve().parent / "results" / "forward_floors.json"
PREFIX = 2048
SUFFIX = 20
TARGETS = {"decode": 1.3, "warm_2k": 1.5}


class Bench:
    """One engine (its loop thread running) and the measurements of one round."""

    def __init__(self, engine: LLMEngine, tokens: int) -> None:
        self.engine, self.model, self.runner = engine, engine.model, engine.runner
        self.tokens = tokens
        self.rng = random.Random(0)
        self.ids = itertools.count()
        self.prefix = [self.rng.randrange(100, 1000) for _ in range(PREFIX)]
        # The runner-only rows write K/V into the highest blocks, which the engine's
        # requests here never reach (they use a few hundred of the lowest).
        top = engine.storage.num_blocks
        self.decode_blocks = list(range(top - 8, top))
        self.warm_blocks = list(range(top - 8 - 130, top - 8))

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(1000, 20000) for _ in range(n)]

    def bare(self, n: int) -> Sample:
        ids = torch.tensor([self.fresh(n)])
        start = _now()
        with torch.inference_mode():
            self.model(ids, logits_to_keep=1)
        return _since(start)

    def runner_decode(self) -> Sample:
        start = _now()
        self.runner.execute([SequenceInput(self.fresh(1), 100, self.decode_blocks, True)])
        return _since(start)

    def runner_warm(self) -> Sample:
        start = _now()
        self.runner.execute([SequenceInput(self.fresh(SUFFIX), PREFIX, self.warm_blocks, True)])
        return _since(start)

    def _submit(self, prompt: list[int], max_tokens: int) -> tuple[Sample, list[Sample], int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = _now()
        stream = self.engine.submit(GenerationRequest(f"bench-{next(self.ids)}", prompt, params))
        stamps, cached = [], 0
        for output in stream.outputs(timeout=600):
            if output.error:
                raise RuntimeError(output.error)
            if output.new_token_ids:
                stamps.append(_now())
            cached = output.num_cached_tokens
        return start, stamps, cached

    def engine_decode(self) -> Sample:
        _, stamps, _ = self._submit(self.fresh(100), self.tokens)
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(stamps)]
        return statistics.median(w for w, _ in steps), statistics.median(c for _, c in steps)

    def engine_warm(self) -> Sample:
        start, stamps, cached = self._submit(self.prefix + self.fresh(SUFFIX), 1)
        if cached != PREFIX:
            raise RuntimeError(f"the warm request hit {cached} cached tokens, not {PREFIX}")
        return stamps[-1][0] - start[0], stamps[-1][1] - start[1]


Sample = tuple[float, float]
"""(wall seconds, process CPU seconds: every thread of this process, torch's included)."""


def _now() -> Sample:
    return time.perf_counter(), time.process_time()


def _since(start: Sample) -> Sample:
    wall, cpu = _now()
    return wall - start[0], cpu - start[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=15, help="measured rounds (default: 15)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds not counted (default: 2)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens of each engine decode run (default: 16)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.tokens < 3:
        parser.error("--rounds must be >= 1, --warmup >= 0 and --tokens >= 3")
    engine = LLMEngine.launch(
        EngineConfig(dtype=args.dtype, kv_cache_memory_gib=0.3, seed=0, num_threads=args.threads)
    )
    threads = engine.call(torch.get_num_threads)
    bench = Bench(engine, args.tokens)
    bench._submit(bench.prefix + bench.fresh(SUFFIX), 1)  # computes and caches the 2k prefix
    kinds: dict[str, Callable[[], Sample]] = {
        "bare_1": lambda: engine.call(lambda: bench.bare(1)),
        "runner_decode": lambda: engine.call(bench.runner_decode),
        "engine_decode": bench.engine_decode,
        "bare_20": lambda: engine.call(lambda: bench.bare(SUFFIX)),
        "runner_warm_2k": lambda: engine.call(bench.runner_warm),
        "engine_warm_2k": bench.engine_warm,
    }
    names = list(kinds)
    samples: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    load_before = os.getloadavg()
    try:
        for i in range(args.warmup + args.rounds):
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                wall, used = kinds[name]()
                if i >= args.warmup:
                    samples[name].append(wall * 1e3)
                    cpu[name].append(used * 1e3)
    finally:
        engine.shutdown()
    load_after = os.getloadavg()
    stats = {
        "median": {k: statistics.median(v) for k, v in samples.items()},
        "min": {k: min(v) for k, v in samples.items()},
        "cpu_median": {k: statistics.median(v) for k, v in cpu.items()},
    }
    pairs = [("engine_decode", "bare_1"), ("runner_decode", "bare_1"),
             ("engine_warm_2k", "bare_20"), ("runner_warm_2k", "bare_20")]
    ratios = {f"{a} / {b}": {s: stats[s][a] / stats[s][b] for s in stats} for a, b in pairs}
    print(f"threads={threads} dtype={str(engine.layout.dtype).removeprefix('torch.')} "
          f"rounds={args.rounds} load before {load_before[0]:.2f} after {load_after[0]:.2f}")
    print(f"{'kind':>16} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'cpu ms':>8}")
    for k in names:
        print(f"{k:>16} {stats['median'][k]:10.1f} {stats['min'][k]:8.1f} {max(samples[k]):8.1f} "
              f"{stats['cpu_median'][k]:8.1f}")
    print(f"{'ratio':>26} {'median':>7} {'min':>6} {'cpu':>6}  target")
    for k, v in ratios.items():
        target = TARGETS["decode" if "decode" in k else "warm_2k"]
        print(f"{k:>26} {v['median']:6.2f}x {v['min']:5.2f}x {v['cpu_median']:5.2f}x  <= {target}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "forward_floors", "threads": threads,
        "dtype": str(engine.layout.dtype).removeprefix("torch."), "rounds": args.rounds,
        "decode_tokens": args.tokens, "load_avg_before": load_before, "load_avg_after": load_after,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "ms": stats, "samples_ms": samples, "cpu_samples_ms": cpu, "ratios": ratios, "targets": TARGETS,
    }, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
