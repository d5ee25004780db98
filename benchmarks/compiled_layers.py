"""Compiled per-layer ops (inductor) against eager: bits, decode-step speed, compile cost.

:class:`compiled_kernels.CompiledLayers` (``benchmarks/compiled_kernels.py``) compiles a Llama layer's work
outside attention and the products (residual add + RMSNorm, RoPE, ``silu * up``)
with ``torch.compile``. On the bundled model, in one process (the runner on the main
thread, torch's threads unless ``--threads``):

1. **Bits per kernel.** Real hidden states of a 512-token prompt (captured at four
   layers' inputs, with the attention outputs), sliced to 1, 4, 8, 16 and 512 rows:
   each compiled kernel against its eager ops, ``torch.equal``; with ``--plain`` also
   inductor's defaults (no precision-cast emulation, ``rms_norm`` as torch writes
   it), to show what differs without the two fixes.
2. **Bits per step.** The same runner steps eager and compiled: a 512-token prefill
   chunk, a lone decode, an 8-row decode and a mixed step (a 40-token chunk beside 7
   decodes): logits and the whole K/V storage compared.
3. **Compile cost.** Wall time of the first compiled call per row count and the
   graphs dynamo compiled (recompiles per row count).
4. **Speed.** A lone decode and an 8-sequence decode at 129 positions of context,
   eager and compiled alternated ``--rounds`` times x ``--steps`` steps; medians
   of the per-round mean step (wall and this thread's CPU time).

Usage: .venv/bin/python benchmarks/compiled_layers.py [--rounds 15] [--steps 10] [--threads N] [--plain]
       [--backend aoti|compile] [--weights dense|q4_1] [--speed-only]
Example: .venv/bin/python benchmarks/compiled_layers.py --rounds 9
Writes benchmarks/results/compiled_layers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from compiled_kernels import CompiledLayers

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model import llama
from engine.model.runner import SequenceInput

RESULTS = Path(__file__).resolve().parent / "results" / "compiled_layers.json"
ROWS = (1, 4, 8, 16, 512)
LAYERS = (0, 7, 15, 29)


def _capture(engine: LLMEngine, fw: llama.LlamaForward, prompt: list[int]) -> dict[str, list[torch.Tensor]]:
    """Layer inputs and attention outputs of an eager forward of ``prompt`` (``fw``: the
    runner's forward, run eagerly)."""
    captured: dict[str, list[torch.Tensor]] = {"hidden": [], "attention": []}
    attend, layer_step = llama.paged_attention, fw._layer

    def attention(*args: Any) -> torch.Tensor:
        out = attend(*args)
        captured["attention"].append(out.clone())
        return out

    def layer(i: int, lay: Any, hidden: torch.Tensor, *args: Any) -> None:
        captured["hidden"].append(hidden.clone())
        layer_step(i, lay, hidden, *args)

    llama.paged_attention = attention  # type: ignore[assignment]
    fw._layer = layer  # type: ignore[method-assign,assignment]
    try:
        engine.runner.execute([SequenceInput(prompt, 0, list(range(64)), True)])
    finally:
        llama.paged_attention = attend
        del fw._layer
    return captured


def _differ(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    return {"equal": bool(torch.equal(a, b)), "elements_differ": int((a != b).sum()), "numel": a.numel(),
            "max_abs": float((a.float() - b.float()).abs().max())}


def kernel_bits(engine: LLMEngine, fw: llama.LlamaForward, compiled: CompiledLayers,
                plain: CompiledLayers | None) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    captured = _capture(engine, fw, torch.randint(1000, 20000, (512,), generator=gen).tolist())
    cos, signed_sin = fw._angles(captured["hidden"][0], torch.arange(512))
    qk_heads = fw.num_heads + fw.kv_heads
    rows_out = []
    with torch.inference_mode():
        for rows in ROWS:
            for name, kernels in (("compiled", compiled), ("plain", plain)):
                if kernels is None:
                    continue
                found: dict[str, list[dict[str, Any]]] = {}
                for index in LAYERS:
                    lay = fw.layers[index]
                    hidden = captured["hidden"][index][:rows]
                    x = llama._rms_norm(hidden, lay.input_norm, fw.eps)
                    qkv = lay.qkv(x)
                    qk = llama._rope(qkv.view(rows, -1, fw.head_dim)[:, :qk_heads], cos[:rows], signed_sin[:rows])
                    o = lay.o(captured["attention"][index][:rows])
                    after = hidden + o
                    post = llama._rms_norm(after, lay.post_norm, fw.eps)
                    gate_up = lay.gate_up(post)
                    half = gate_up.shape[1] // 2
                    act = F.silu(gate_up[:, :half]) * gate_up[:, half:]
                    got_after, got_post = kernels.add_norm(hidden, o, lay.post_norm)
                    for op, want, got in (("norm", x, kernels.norm(hidden, lay.input_norm)[0]),
                                          ("rope", qk, kernels.rope(qkv, cos[:rows], signed_sin[:rows])[0]),
                                          ("add", after, got_after), ("add_norm", post, got_post),
                                          ("silu_mul", act, kernels.silu_mul(gate_up)[0])):
                        found.setdefault(op, []).append(_differ(got, want))
                for op, results in found.items():
                    rows_out.append({"kernels": name, "rows": rows, "op": op,
                                     "equal": all(r["equal"] for r in results),
                                     "elements_differ": sum(r["elements_differ"] for r in results),
                                     "numel": sum(r["numel"] for r in results),
                                     "max_abs": max(r["max_abs"] for r in results)})
    return rows_out


class Switch:
    """Stands in for the runner's Llama forward: eager or compiled layers, switchable."""

    def __init__(self, forward: llama.LlamaForward, compiled: CompiledLayers) -> None:
        self.forward, self.compiled, self.use_compiled = forward, compiled, False
        self.row_multiple = forward.row_multiple

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Any, logit_rows: torch.Tensor,
                 embeds: Any = None) -> torch.Tensor:
        fw = self.forward
        if not self.use_compiled:
            return fw(input_ids, positions, batch, logit_rows, embeds)
        with torch.inference_mode():
            hidden = F.embedding(input_ids, fw.embed)
            cos, signed_sin = fw._angles(hidden, positions)
            hidden = self.compiled.run(fw.layers, hidden, cos, signed_sin, batch, fw.scale)
            return fw.lm_head(llama._rms_norm(hidden[logit_rows], fw.norm, fw.eps))


def _steps(context: int) -> dict[str, list[SequenceInput]]:
    """The steps measured (block tables 40 blocks apart, one per sequence)."""
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, 20000, (n,), generator=gen).tolist()

    def table(s: int) -> list[int]:
        return list(range(40 * s, 40 * s + 40))

    return {
        "prefill 512": [SequenceInput(tokens(512), 0, table(0), True)],
        "decode 1": [SequenceInput(tokens(1), context, table(0), True)],
        "decode 8": [SequenceInput(tokens(1), context, table(s), True) for s in range(8)],
        "mixed 40+7": [SequenceInput(tokens(40), 64, table(8), True),
                       *(SequenceInput(tokens(1), context, table(s), True) for s in range(7))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="eager/compiled alternations (default: 15)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round and mode (default: 10)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--plain", action="store_true", help="also check inductor's defaults' bits")
    parser.add_argument("--backend", choices=("compile", "aoti"), default="aoti",
                        help="torch.compile or AOTInductor (default: aoti)")
    parser.add_argument("--weights", choices=("dense", "q4_1"), default="dense",
                        help="the projections' weights (EngineConfig.weights; default: dense)")
    parser.add_argument("--speed-only", action="store_true", help="only the decode steps: no bits, no prefill")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be >= 1")
    load_before = os.getloadavg()[0]
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory_gib=0.25, seed=0, num_threads=args.threads,
                                                weights=args.weights,
                                                dtype="bfloat16" if args.weights == "q4_1" else "auto"))
    fw = engine.runner._llama
    if fw is None:
        parser.error("the model does not run the Llama forward")
    storage = engine.storage
    threads = torch.get_num_threads()
    config = engine.model.config
    dims = (fw.eps, fw.num_heads, fw.kv_heads, fw.head_dim, config.hidden_size, config.intermediate_size,
            engine.layout.dtype)
    compiled = CompiledLayers(*dims, backend=args.backend)
    plain = CompiledLayers(*dims, exact=False, backend=args.backend) if args.plain else None
    differ = compiled.check()

    switch = Switch(fw, compiled)
    engine.runner._llama = switch  # type: ignore[assignment]
    context = 129
    steps = _steps(context)
    # K/V for the context of every sequence, eagerly
    with torch.inference_mode():
        fill = torch.Generator().manual_seed(2)
        for s in range(9):
            table = list(range(40 * s, 40 * s + 40))
            engine.runner.execute([SequenceInput(torch.randint(1000, 20000, (context,), generator=fill).tolist(),
                                                 0, table, True)])

    # 3. compile cost: the first compiled call of each step (dynamo's graph count after each)
    counters = torch._dynamo.utils.counters
    compile_rows: list[dict[str, Any]] = []
    switch.use_compiled = True
    for name in ("decode 1", "decode 8") if args.speed_only else ("decode 1", "decode 8", "mixed 40+7", "prefill 512"):
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        engine.runner.execute(steps[name])
        first = time.perf_counter() - start
        start = time.perf_counter()
        engine.runner.execute(steps[name])
        second = time.perf_counter() - start
        compile_rows.append({"step": name, "first_call_s": first, "second_call_s": second,
                             "new_graphs": counters["stats"]["unique_graphs"] - before})

    # 2. bits per step: logits and the whole K/V storage, eager then compiled on the same input
    step_rows: list[dict[str, Any]] = []
    for name, seqs in () if args.speed_only else steps.items():
        out = {}
        for mode in (False, True):
            switch.use_compiled = mode
            logits = engine.runner.execute(seqs)
            out[mode] = (logits, storage.all_keys.clone(), storage.all_values.clone())
        step_rows.append({"step": name, "logits_equal": bool(torch.equal(out[False][0], out[True][0])),
                          "keys_equal": bool(torch.equal(out[False][1], out[True][1])),
                          "values_equal": bool(torch.equal(out[False][2], out[True][2])),
                          "logits_max_abs": float((out[False][0] - out[True][0]).abs().max())})
        del out

    # 1. bits per kernel
    switch.use_compiled = False
    bits = [] if args.speed_only else kernel_bits(engine, fw, compiled, plain)

    # 4. speed
    def measure(seqs: list[SequenceInput]) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            engine.runner.execute(seqs)
        return (time.perf_counter() - start) / args.steps * 1e3, (time.thread_time() - cpu) / args.steps * 1e3

    speed_rows: list[dict[str, Any]] = []
    for name in ("decode 1", "decode 8"):
        samples: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for r in range(args.rounds):
            for mode in ((False, True) if r % 2 == 0 else (True, False)):
                switch.use_compiled = mode
                samples[mode].append(measure(steps[name]))
        eager_wall = statistics.median(s[0] for s in samples[False])
        comp_wall = statistics.median(s[0] for s in samples[True])
        eager_cpu = statistics.median(s[1] for s in samples[False])
        comp_cpu = statistics.median(s[1] for s in samples[True])
        speed_rows.append({"step": name, "eager_wall_ms": eager_wall, "compiled_wall_ms": comp_wall,
                           "ratio_wall": comp_wall / eager_wall, "eager_cpu_ms": eager_cpu,
                           "compiled_cpu_ms": comp_cpu, "ratio_cpu": comp_cpu / eager_cpu})
    load_after = os.getloadavg()[0]

    print(f"weights={args.weights} backend={args.backend} threads={threads} load before {load_before:.2f} "
          f"after {load_after:.2f}; sum lanes {compiled.lanes}; torch {torch.__version__}")
    print(f"CompiledLayers.check (random probes, 1/3/8/40 rows): {', '.join(differ) or 'every kernel exact'}")
    print("\nbits per kernel (real hidden states, layers " + ", ".join(map(str, LAYERS)) + ")")
    print(f"{'kernels':>9} {'rows':>5} {'op':>9} {'equal':>6} {'differ':>14} {'max abs':>8}")
    for b in bits:
        print(f"{b['kernels']:>9} {b['rows']:>5} {b['op']:>9} {b['equal']!s:>6} "
              f"{b['elements_differ']:>7}/{b['numel']:<7} {b['max_abs']:>8.3g}")
    print("\nbits per step (eager vs compiled, same input)")
    for row in step_rows:
        print(f"  {row['step']:<12} logits {row['logits_equal']!s:<5} keys {row['keys_equal']!s:<5} "
              f"values {row['values_equal']!s:<5} (max abs {row['logits_max_abs']:.3g})")
    print("\ncompile cost (first compiled call of each step, then the second)")
    for cost in compile_rows:
        print(f"  {cost['step']:<12} first {cost['first_call_s']:7.2f} s  second {cost['second_call_s'] * 1e3:7.1f} ms  "
              f"new graphs {cost['new_graphs']}")
    print("  build: " + ", ".join(f"{k} {v:.1f} s" for k, v in compiled.compile_seconds.items()))
    print(f"\nspeed ({args.rounds} rounds x {args.steps} steps, medians of round means, {context} positions)")
    print(f"{'step':<10} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6} {'eager cpu':>10} {'comp cpu':>9} {'ratio':>6}")
    for speed in speed_rows:
        print(f"{speed['step']:<10} {speed['eager_wall_ms']:>9.2f} {speed['compiled_wall_ms']:>12.2f} "
              f"{speed['ratio_wall']:>6.3f} {speed['eager_cpu_ms']:>10.2f} {speed['compiled_cpu_ms']:>9.2f} "
              f"{speed['ratio_cpu']:>6.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "compiled_layers", "threads": threads, "torch": torch.__version__, "rounds": args.rounds,
        "steps": args.steps, "context": context, "load_before": load_before, "load_after": load_after,
        "sum_lanes": compiled.lanes, "check_differ": differ, "kernel_bits": bits, "step_bits": step_rows, "compile": compile_rows,
        "build_seconds": compiled.compile_seconds, "backend": args.backend, "weights": args.weights,
        "speed": speed_rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
