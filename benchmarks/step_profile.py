"""Where one decode step's time goes, in process (``batching.py --profile``).

An engine is launched (``LLMEngine.launch``: the loop thread loads the model and runs
every forward, as in ``prefixgate engine``), ``streams`` greedy requests of 24-token
prompts are submitted, and once every one of them has its first token (prefills
done) the engine's decode steps are measured twice, each over ``steps`` steps:

* **plain**: the wall time of ``LLMEngine.step`` (a ``perf_counter`` around it), no
  profiler: what a step costs; and the loop thread's CPU time of the step
  (``time.thread_time``): with ``--engine-threads 1`` the figure to read on a shared
  machine, where waiting for a core inflates wall times (at load 10-13 on 2 cores,
  3x);
* **profiled**: ``torch.profiler`` on the loop thread, with a named scope around each
  part of the step (wrappers installed in this process only): the projections
  (``PackedLinear`` calls of the layers), the LM head, attention (K/V write, gather,
  the two products, softmax), RMSNorms, RoPE, sampling, and the output hand-off
  (detokenizing, the stream). ``rest of forward`` is the runner's time outside those
  scopes (input tensors, embedding, residual adds, ``silu * up``, the Python between
  ops); ``rest of step`` is the step outside the forward, sampling and hand-off
  (scheduling, block tables). ``aten calls`` counts the ATen and oneDNN calls a step
  dispatches, nested ones included (``to`` -> ``_to_copy`` -> ``copy_`` is three).

The scopes themselves cost a few microseconds each (~200 per step), so the profiled
step is slower than the plain one; the shares are what to read.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from engine.config import EngineConfig
from engine.core import llm_engine
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model import llama

PARTS = ["projections", "LM head", "attention", "norms", "RoPE", "sampling", "hand-off"]
_ids = itertools.count()


def _scoped(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)

    return inner


def _instrument(engine: LLMEngine) -> Callable[[], None]:
    """Named scopes around the parts of a step (this process only); returns the undo."""
    forward = engine.runner._llama
    if forward is None:
        raise ValueError("--profile needs the Llama forward (the bundled model)")
    for layer in forward.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, _scoped("projections", getattr(layer, name)))
    forward.lm_head = _scoped("LM head", forward.lm_head)  # type: ignore[assignment]
    engine.runner.execute = _scoped("forward", engine.runner.execute)  # type: ignore[method-assign]
    engine._emit = _scoped("hand-off", engine._emit)  # type: ignore[method-assign]
    patched = [(llama, "paged_attention", "attention"), (llama, "_rms_norm", "norms"), (llama, "_rope", "RoPE"),
               (llm_engine, "sample", "sampling")]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in patched]
    for module, attr, scope in patched:
        setattr(module, attr, _scoped(scope, getattr(module, attr)))

    def undo() -> None:
        for module, attr, original in saved:
            setattr(module, attr, original)

    return undo


def profile_decode(streams: int, steps: int, prompts: list[list[int]], num_threads: int | None = None,
                   weights: str = "dense") -> dict[str, Any]:
    """Per-step milliseconds of each part of a decode step with ``streams`` running
    requests (``prompts``: one per stream), plain and profiled (see the module doc)."""
    # plain decode steps: one token per request (no draft rows)
    engine = LLMEngine.launch(EngineConfig(num_threads=num_threads, seed=0, weights=weights, speculative_tokens=0))
    try:
        return _measure(engine, streams, steps, prompts)
    finally:
        engine.shutdown()


def _measure(engine: LLMEngine, streams: int, steps: int, prompts: list[list[int]]) -> dict[str, Any]:
    step = engine.step
    plain: list[float] = []
    plain_cpu: list[float] = []
    profiled = [0]
    undo: list[Callable[[], None]] = []
    prof = profile(activities=[ProfilerActivity.CPU])
    done = threading.Event()

    def measured_step() -> None:  # on the loop thread: plain steps, then profiled ones
        if len(plain) < steps:
            start, cpu = time.perf_counter(), time.thread_time()
            step()
            plain.append(time.perf_counter() - start)
            plain_cpu.append(time.thread_time() - cpu)
            if len(plain) == steps:
                undo.append(_instrument(engine))
                prof.start()
        elif profiled[0] < steps:
            with record_function("step"):
                step()
            profiled[0] += 1
            if profiled[0] == steps:
                prof.stop()
                undo.pop()()
                done.set()
        else:
            step()

    params = SamplingParams(max_tokens=2 * steps + 16, temperature=0.0, ignore_eos=True)
    outputs = [engine.submit(GenerationRequest(f"profile-{next(_ids)}", p, params)) for p in prompts[:streams]]
    for stream in outputs:  # every prefill done: from here on the steps are decodes
        next(iter(stream.outputs(timeout=600)))
    engine.call(lambda: setattr(engine, "step", measured_step))
    if not done.wait(timeout=600):
        raise RuntimeError("the profiled decode steps did not finish in 600 s")
    for stream in outputs:
        stream.cancel()
    totals: dict[str, float] = {}
    aten_ops = 0
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::")):
            aten_ops += event.count
        totals[event.key] = event.cpu_time_total / 1e3
    per = {k: totals.get(k, 0.0) / steps for k in ["step", "forward", *PARTS]}
    inside = sum(per[k] for k in ("projections", "LM head", "attention", "norms", "RoPE"))
    parts = {k: per[k] for k in PARTS}
    parts["rest of forward"] = per["forward"] - inside
    parts["rest of step"] = per["step"] - per["forward"] - per["sampling"] - per["hand-off"]
    return {
        "streams": streams,
        "steps": steps,
        "plain_step_ms_median": statistics.median(plain) * 1e3,
        "plain_step_ms_min": min(plain) * 1e3,
        "plain_step_cpu_ms_median": statistics.median(plain_cpu) * 1e3,
        "profiled_step_ms": per["step"],
        "parts_ms": parts,
        "aten_ops_per_step": aten_ops / steps,
    }


def show(row: dict[str, Any]) -> str:
    """A table of one :func:`profile_decode` result."""
    step = row["profiled_step_ms"] or 1.0
    lines = [
        f"decode step, {row['streams']} stream(s): plain median {row['plain_step_ms_median']:.1f} ms "
        f"(min {row['plain_step_ms_min']:.1f}, loop thread CPU {row['plain_step_cpu_ms_median']:.1f}) "
        f"over {row['steps']} steps; profiled {step:.1f} ms, "
        f"{row['aten_ops_per_step']:.0f} aten calls per step",
    ]
    for name, ms in sorted(row["parts_ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:>16} {ms:7.2f} ms {100 * ms / step:5.1f}%")
    return "\n".join(lines)
