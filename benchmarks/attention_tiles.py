"""What attention's row tiles cost: the runner with ``PV_TILE`` = 16 (the engine's) against
one untiled probabilities-times-values product per call, interleaved in one process.

``engine/model/attention.py`` runs that product in tiles of at most 16 rows so that a
token gets the same bits in a cold prefill chunk, a warm tail and a decode. This
measures the price on the bundled model, on the runner alone (no engine loop), per
kind: ``cold_2k`` (a 2,048-token prompt in 4 chunks of 512), ``warm_20_over_2k`` (20
tokens over a cached 2,028-token prefix), ``decode_1_at_2k`` and ``decode_8_at_2k``
(one step of 1 or 8 sequences at 2k positions). Rounds alternate the order of the two
variants after one warm-up round. Per kind and variant: the median wall time and the
median process CPU time (all threads), and their ratios (tiled / untiled). Writes
benchmarks/results/attention_tiles.json.

Usage: .venv/bin/python benchmarks/attention_tiles.py [--rounds 3] [--dtype auto|bfloat16|float32]
Example: HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/attention_tiles.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model import attention
from engine.model.runner import SequenceInput

RESULTS = Path(__file__).resolve().parent / "results" / "attention_tiles.json"
VARIANTS = {"untiled": 10**9, "tiled": attention.PV_TILE}


def kinds(engine: LLMEngine) -> dict[str, tuple[Callable[[], object], int]]:
    """Each kind's work and how many times a round repeats it."""
    runner = engine.runner
    prompt = [(7 * i) % 20000 + 100 for i in range(2048)]
    blocks = list(range(1, 2048 // engine.block_size + 2))

    def cold() -> None:
        for s in range(0, 2048, 512):
            runner.execute([SequenceInput(prompt[s : s + 512], s, blocks, s == 1536)])

    return {
        "cold_2k": (cold, 1),
        "warm_20_over_2k": (lambda: runner.execute([SequenceInput(prompt[2028:], 2028, blocks, True)]), 5),
        "decode_1_at_2k": (lambda: runner.execute([SequenceInput([11], 2048, blocks, True)]), 5),
        "decode_8_at_2k": (lambda: runner.execute(
            [SequenceInput([11], 2048 - i, blocks, True) for i in range(8)]), 5),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory_gib=0.25, seed=0, dtype=args.dtype))
    work = kinds(engine)
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {(k, v): [] for k in work for v in VARIANTS}
    tile = attention.PV_TILE
    try:
        for r in range(args.rounds + 1):
            order = list(VARIANTS.items())[:: 1 if r % 2 else -1]
            for variant, rows in order:
                attention.PV_TILE = rows
                for kind, (run, reps) in work.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    for _ in range(reps):
                        run()
                    if r:  # round 0 warms up
                        samples[(kind, variant)].append(
                            ((time.perf_counter() - wall) / reps * 1e3, (time.process_time() - cpu) / reps * 1e3))
    finally:
        attention.PV_TILE = tile
    rows_out = []
    print(f"{'kind':18} {'untiled ms':>10} {'tiled ms':>9} {'ratio':>6} {'cpu untiled':>11} {'cpu tiled':>9} {'ratio':>6}")
    for kind in work:
        med = {v: [statistics.median(s[i] for s in samples[(kind, v)]) for i in (0, 1)] for v in VARIANTS}
        (uw, uc), (tw, tc) = med["untiled"], med["tiled"]
        print(f"{kind:18} {uw:10.1f} {tw:9.1f} {tw / uw:6.2f} {uc:11.1f} {tc:9.1f} {tc / uc:6.2f}")
        rows_out.append({"kind": kind, "untiled_ms": uw, "tiled_ms": tw, "untiled_cpu_ms": uc, "tiled_cpu_ms": tc})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rounds": args.rounds, "dtype": args.dtype, "pv_tile": tile, "kinds": rows_out},
                                  indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
