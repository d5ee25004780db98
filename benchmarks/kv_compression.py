"""KV compression (``--kv-compression pyramid``) against exact KV, in one run of this script.

The bundled model in process (``LLMEngine.launch``), text that this project did not
write: the licences in /usr/share/common-licenses (distinct files, by content).

(a) KV held per request: a compressed request of ``--sizes`` prompt tokens (2k),
    the blocks it holds right after its compression against the ``ceil(tokens / 16)``
    blocks an exact request holds then (and bytes); for ``--computed-sizes`` (2k, 4k,
    8k) the same figure computed from the schedule (which tokens are kept does not
    change how many), without running 8k-token prefills on a shared CPU.
(b) Quality: perplexity of held-out continuations. Compression happens after the
    prompt's prefill, so the prompt's own logprobs cannot show it; as the paper
    measures decoding under compressed KV, each document's first 2,048 tokens are the
    prompt and its next ``--continuation`` tokens are teacher-forced as the output
    (:class:`~engine.core.forced_tokens.ForcedTokens`, with ``logprobs=0``: each
    forced token's logprob under the raw distribution). Exact mode is scored the same
    way, and cross-checked against ``prompt_logprobs`` of prompt + continuation in
    one exact request (the same numbers up to bfloat16 batch effects). Swept over
    ``--retentions`` (the deepest layer's share; the window fixed), with decode-time
    re-selection (every ``--window`` decoded tokens; the default 256 forced tokens
    re-select 8 times) and, at ``--throughput-retention``, without it.
(c) Throughput at a small pool: a second engine whose pool holds about four exact
    requests (2k prompt + output); 16 streams at once, each a shared 1,920-token
    document prefix plus its own 128-token tail (a RAG-like batch: prefix reuse works
    for both modes), ``--tokens`` greedy output tokens each (``ignore_eos``); exact
    batch then the compressed batches (``--modes``: ``pyramid``,
    ``pyramid+progressive``, compressed chunk by chunk while prefilling, and
    ``pyramid+layerwise``, the same computing each chunk's tokens only in the layers up
    to the last that keeps them, PyramidInfer's prefill), each under
    its own cache salt (each prefills the prefix once). Output tokens/s over each
    batch's wall time. Then (part "d", the issue's workload) the same with 16 distinct
    2,048-token prompts (nothing shared). Also recorded: requests running per step
    (mean, max) and re-selections. ``--rounds N``: the modes alternate N times in the
    same engine (each round under salts of its own), each round's ratio against the
    same round's exact batch; the median round is reported with every round's ratio
    (the exact baseline moves by ~10% between runs on a 2-core machine).
(e) Prefill: one 2,048-token prompt alone, time to its first token per mode
    (``--runs``, medians; the modes alternate run by run).

Targets (issue 22): (a) <= 0.5x exact at 2k with (b) perplexity <= 1.10x exact;
(c) >= 1.8x output tokens/s. Prints a table, writes benchmarks/results/kv_compression.json.

Usage: .venv/bin/python benchmarks/kv_compression.py [--retentions 0.3 0.2 0.1] [--docs 3] [--rounds 3]
       [--continuation 256] [--tokens 256] [--sizes 2048] [--computed-sizes 2048 4096 8000] [--skip a b c]
Example: .venv/bin/python benchmarks/kv_compression.py --retentions 0.5 0.3 0.2 0.1 --docs 6
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig
from engine.core.forced_tokens import ForcedTokens
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model.packed_kv import PackedKV
from engine.model.pyramid import DEFAULT_CHUNK, LAYERWISE_CHUNK, PyramidSchedule

RESULTS = Path(__file__).resolve().parent / "results" / "kv_compression.json"
LICENSES = Path("/usr/share/common-licenses")
CONTEXT = 2048
SHARED = 1920
TAIL = 128
STREAMS = 16
_n = 0


def documents(tok: Any) -> dict[str, list[int]]:
    """Distinct licence texts (by content) as token ids, longest first."""
    seen: set[str] = set()
    docs: dict[str, list[int]] = {}
    for path in sorted(LICENSES.iterdir()):
        text = path.read_text(errors="replace")
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        docs[path.name] = tok.encode(text, add_special_tokens=False)
    return dict(sorted(docs.items(), key=lambda kv: -len(kv[1])))


def submit(engine: LLMEngine, prompt: list[int], mode: str, salt: str, **params: Any) -> Any:
    global _n
    _n += 1
    params.setdefault("temperature", 0.0)
    return engine.submit(GenerationRequest(f"bench-{_n}", prompt, SamplingParams(**params), cache_salt=salt,
                                           kv_compression=mode))


def record_packed_blocks(engine: LLMEngine) -> dict[str, int]:
    """Blocks each request holds right after its compression (wraps the scheduler's call)."""
    held: dict[str, int] = {}
    compress = engine.scheduler.compress

    def wrapped(req: Any, *args: Any) -> bool:
        done = compress(req, *args)
        if done:
            held[req.request_id] = len(engine.kv_cache_manager.get_block_ids(req.request_id))
        return done

    engine.scheduler.compress = wrapped  # type: ignore[method-assign]
    return held


def kv_held(engine: LLMEngine, docs: dict[str, list[int]], sizes: list[int],
            computed: list[int]) -> list[dict[str, Any]]:
    held = record_packed_blocks(engine)
    text = [t for d in docs.values() for t in d]
    bs, per_block = engine.block_size, engine.layout.bytes_per_block
    rows = []
    layers = engine.layout.num_layers
    for size in computed:
        exact = -(-size // bs)
        blocks = PackedKV.blocks_for(engine.pyramid.keep_counts(size, layers), bs)
        rows.append({"prompt_tokens": size, "exact_blocks": exact, "compressed_blocks": blocks, "measured": False,
                     "exact_mib": exact * per_block / 2**20, "compressed_mib": blocks * per_block / 2**20,
                     "ratio": blocks / exact})
        print(f"  (a) {size:>5} tokens: exact {exact} blocks, compressed {blocks} blocks "
              f"({rows[-1]['ratio']:.3f}x, computed from the schedule)", flush=True)
    for size in sizes:
        stream = submit(engine, text[:size], "pyramid", f"a{size}", max_tokens=2)
        out = stream.result(timeout=3600)
        blocks = held.get(stream.request_id)
        exact = -(-size // bs)
        rows.append({"prompt_tokens": size, "exact_blocks": exact, "compressed_blocks": blocks, "measured": True,
                     "exact_mib": exact * per_block / 2**20,
                     "compressed_mib": None if blocks is None else blocks * per_block / 2**20,
                     "ratio": None if blocks is None else blocks / exact, "finish": out[-1].finish_reason})
        print(f"  (a) {size:>5} tokens: exact {exact} blocks, compressed {blocks} blocks "
              f"({rows[-1]['ratio']:.3f}x)", flush=True)
    return rows


def chunk_for(chunk: int | None, layerwise: bool) -> int:
    """``--chunk``, else the engine's default for the mode."""
    if chunk is not None:
        return chunk
    return LAYERWISE_CHUNK if layerwise else DEFAULT_CHUNK


def nll(outputs: list[Any]) -> list[float]:
    return [-e.logprob for o in outputs for e in (o.logprobs or [])]


def perplexity(engine: LLMEngine, docs: dict[str, list[int]], retentions: list[float], pools: list[int],
               n: int, window: int, num_docs: int, no_reselect: float, chunk: int | None) -> dict[str, Any]:
    chosen = dict(list((name, ids) for name, ids in docs.items() if len(ids) >= CONTEXT + n)[:num_docs])
    prompts = {name: ids[:CONTEXT] for name, ids in chosen.items()}
    targets = {name: ids[CONTEXT : CONTEXT + n] for name, ids in chosen.items()}
    # exact, through prompt_logprobs of prompt + continuation (one request per document)
    streams = {name: submit(engine, prompts[name] + targets[name], "none", "b", max_tokens=1, prompt_logprobs=0)
               for name in chosen}
    by_prompt = {}
    for name, stream in streams.items():
        entries = stream.result(timeout=3600)[0].prompt_logprobs
        by_prompt[name] = [-e.logprob for e in entries[CONTEXT:]]

    def forced(mode: str, salt: str = "b") -> dict[str, list[float]]:
        runs = {name: submit(engine, prompts[name], mode, salt, max_tokens=n, logprobs=0,
                             constraint=ForcedTokens(targets[name])) for name in chosen}
        return {name: nll(s.result(timeout=3600)) for name, s in runs.items()}

    def ppl(values: dict[str, list[float]]) -> float:
        flat = [v for vs in values.values() for v in vs]
        return math.exp(sum(flat) / len(flat))

    rows = [{"setting": "exact (prompt_logprobs)", "min_retention": 1.0, "ppl": ppl(by_prompt)}]
    exact = forced("none")
    rows.append({"setting": "exact (forced decode)", "min_retention": 1.0, "ppl": ppl(exact)})
    layers = engine.layout.num_layers
    settings = [(r, pool, True, False, False) for r in retentions for pool in pools]
    settings += [(no_reselect, 1, False, False, False), (no_reselect, 1, True, True, False),
                 (no_reselect, 1, True, True, True)]
    for r, pool, again, progressive, layerwise in settings:
        schedule = PyramidSchedule(r, window, pool=pool, reselect=again, progressive=progressive,
                                   layerwise=layerwise, chunk=chunk_for(chunk, layerwise))
        engine.call(lambda s=schedule: setattr(engine, "pyramid", s))
        before = engine.num_reselections
        kept = sum(schedule.keep_counts(CONTEXT, layers)) / (CONTEXT * layers)
        held = sum(schedule.held_counts(CONTEXT, CONTEXT + n, layers)) / ((CONTEXT + n) * layers)
        rows.append({"setting": f"pyramid min {r:g} pool {pool}" + ("" if again else " no re-selection")
                     + (" layer-wise" if layerwise else " progressive" if progressive else ""),
                     "min_retention": r, "pool": pool, "reselect": again, "progressive": progressive,
                     "layerwise": layerwise,
                     "kept_share": kept,
                     "held_share_at_end_bound": held,
                     # a progressive prefill must not hit the exact prefix the other settings cached
                     "ppl": ppl(forced("pyramid", f"b-{r}-progressive-{layerwise}" if progressive else "b")),
                     "reselections": engine.num_reselections - before})
    base = rows[1]["ppl"]
    for row in rows:
        row["ppl_ratio"] = row["ppl"] / base
        print(f"  (b) {row['setting']:<26} ppl {row['ppl']:8.3f}  {row['ppl_ratio']:.3f}x", flush=True)
    return {"documents": list(chosen), "context": CONTEXT, "continuation": n, "rows": rows}


def prefill_time(engine: LLMEngine, docs: dict[str, list[int]], runs: int, chunk: int | None) -> dict[str, Any]:
    """(e) Time to the first token of one 2,048-token prompt alone, per mode, the modes
    alternating run by run, each run under its own salt (nothing cached)."""
    prompt = [t for d in docs.values() for t in d][:CONTEXT]
    window = engine.pyramid.window
    modes: dict[str, PyramidSchedule | None] = {
        "none": None,
        "pyramid": PyramidSchedule(engine.pyramid.min_retention, window),
        "pyramid+progressive": PyramidSchedule(engine.pyramid.min_retention, window, progressive=True,
                                               chunk=chunk_for(chunk, False)),
        "pyramid+layerwise": PyramidSchedule(engine.pyramid.min_retention, window, progressive=True,
                                             layerwise=True, chunk=chunk_for(chunk, True)),
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for run in range(runs):
        for mode, schedule in modes.items():
            if schedule is not None:
                engine.call(lambda s=schedule: setattr(engine, "pyramid", s))
            start = time.perf_counter()
            submit(engine, prompt, mode.split("+")[0], f"e-{mode}-{run}", max_tokens=1).result(timeout=3600)
            times[mode].append(time.perf_counter() - start)
    out = {mode: {"runs_s": t, "median_s": sorted(t)[len(t) // 2]} for mode, t in times.items()}
    for mode, row in out.items():
        row["ratio"] = row["median_s"] / out["none"]["median_s"]
        print(f"  (e) {mode:>20}: first token after {row['median_s']:.3f} s (median of {runs}), "
              f"{row['ratio']:.2f}x exact", flush=True)
    return out


def one_mode(engine: LLMEngine, mode: str, prompts: list[list[int]], tokens: int, retention: float, window: int,
             chunk: int | None, round_: int, running: list[int], steps: list[tuple[float, bool]]) -> dict[str, Any]:
    """One round of one mode in (c)/(d): every stream submitted at once under a salt of
    its own round (nothing cached from an earlier round), the figures of that round."""
    pyramid = PyramidSchedule(retention, window, progressive=mode in ("pyramid+progressive", "pyramid+layerwise"),
                              layerwise=mode == "pyramid+layerwise",
                              chunk=chunk_for(chunk, mode == "pyramid+layerwise"))
    engine.call(lambda p=pyramid: setattr(engine, "pyramid", p))
    before = engine.stats().num_preemptions
    compressed_before = engine.stats().kv_compressed
    reselections = engine.num_reselections
    running.clear()
    steps.clear()
    start = time.perf_counter()
    streams = [submit(engine, p, mode.split("+")[0], f"c-{mode}-{round_}", max_tokens=tokens, ignore_eos=True)
               for p in prompts]
    total = sum(len(t) for s in streams for t in (o.new_token_ids for o in s.result(timeout=7200)))
    wall = time.perf_counter() - start
    stats = engine.stats()
    row = {"wall_s": wall, "output_tokens": total, "tokens_per_s": total / wall,
           "preemptions": stats.num_preemptions - before,
           "compressed": stats.kv_compressed - compressed_before,
           "reselections": engine.num_reselections - reselections,
           "running_mean": sum(running) / len(running), "running_max": max(running),
           # time between consecutive schedule calls, by whether the step prefilled
           "prefill_steps_s": sum(b[0] - a[0] for a, b in itertools.pairwise(steps) if a[1]),
           "decode_steps_s": sum(b[0] - a[0] for a, b in itertools.pairwise(steps) if not a[1]),
           "decode_steps": sum(1 for _, prefill in steps if not prefill),
           "load_avg_after": os.getloadavg()}
    print(f"  (c) {mode:>8}, round {round_ + 1}: {total} tokens in {wall:.1f} s = {total / wall:.2f} tok/s, running "
          f"{row['running_mean']:.1f} on average (max {row['running_max']}); steps with "
          f"prefill {row['prefill_steps_s']:.0f} s, decode-only {row['decode_steps_s']:.0f} s "
          f"({row['decode_steps']} steps)", flush=True)
    return row


def throughput(docs: dict[str, list[int]], tokens: int, retention: float, window: int,
               threads: int | None, bytes_per_block: int, distinct: bool, modes: list[str],
               chunk: int | None, batched_tokens: int | None = None, rounds: int = 1) -> dict[str, Any]:
    bs = 16
    per_request = -(-(CONTEXT + tokens) // bs)
    names = list(docs)
    if distinct:  # 16 different 2,048-token windows of the licence texts: no prefix to share
        text = [t for d in docs.values() for t in d]
        prompts = [text[i * CONTEXT : (i + 1) * CONTEXT] for i in range(STREAMS)]
    else:
        shared = docs[names[0]][:SHARED]
        tails = [t for d in list(docs.values())[1:] for t in d]
        prompts = [shared + tails[i * TAIL : (i + 1) * TAIL] for i in range(STREAMS)]
    gib = (4 * per_request + 8) * bytes_per_block / 2**30
    budget = {} if batched_tokens is None else {"max_num_batched_tokens": batched_tokens}
    # no draft tokens: compressed requests never draft, so exact ones must not either
    engine = LLMEngine.launch(EngineConfig(kv_cache_memory_gib=gib, seed=0, num_threads=threads, **budget,
                                           kv_min_retention=retention, kv_window=window, speculative_tokens=0))
    out: dict[str, Any] = {"prompts": "distinct" if distinct else "shared 1,920-token prefix", "pool_blocks": engine.kv_cache_manager.num_blocks, "blocks_per_exact_request": per_request,
                           "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                           "streams": STREAMS, "output_tokens_each": tokens}
    running: list[int] = []
    steps: list[tuple[float, bool]] = []  # (when a step was scheduled, whether it prefills)
    schedule = engine.scheduler.schedule

    def counting() -> Any:
        work = schedule()
        if work.scheduled:
            running.append(len(engine.scheduler.running))
            steps.append((time.perf_counter(), any(x.num_new_tokens > 1 for x in work.scheduled)))
        return work

    engine.scheduler.schedule = counting  # type: ignore[method-assign]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    try:
        for round_ in range(rounds):  # the modes alternate, round after round, in this one engine
            for mode in modes:
                runs[mode].append(one_mode(engine, mode, prompts, tokens, retention, window, chunk, round_,
                                           running, steps))
        kv = engine.kv_cache_manager
        engine.call(kv.check_integrity)
        out["all_blocks_free"] = kv.num_free_blocks == kv.num_blocks
    finally:
        engine.shutdown()
    out["rounds"] = rounds
    for mode in modes:  # each round against the same round's exact mode; the median round reported
        for row, exact in zip(runs[mode], runs["none"], strict=True):
            row["ratio"] = row["tokens_per_s"] / exact["tokens_per_s"]
        median = sorted(runs[mode], key=lambda row: row["ratio"])[len(runs[mode]) // 2]
        out[mode] = {**median, "rounds": runs[mode], "round_ratios": [row["ratio"] for row in runs[mode]]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--retentions", type=float, nargs="+", default=[0.3, 0.2, 0.1])
    parser.add_argument("--pools", type=int, nargs="+", default=[1],
                        help="score pooling widths swept in (b) (PyramidSchedule.pool)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048],
                        help="prompt sizes whose compressed blocks are measured (a request each)")
    parser.add_argument("--computed-sizes", type=int, nargs="*", default=[2048, 4096, 8000],
                        help="prompt sizes whose blocks are computed from the schedule (the counts per "
                        "layer do not depend on which tokens are picked)")
    parser.add_argument("--docs", type=int, default=3, help="documents scored in (b)")
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--throughput-retention", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunk", type=int, default=None,
                        help="prefill chunk of the progressive and layer-wise settings (default: the "
                        f"engine's, {DEFAULT_CHUNK} and {LAYERWISE_CHUNK})")
    parser.add_argument("--modes", nargs="+", default=["none", "pyramid", "pyramid+progressive", "pyramid+layerwise"],
                        choices=["none", "pyramid", "pyramid+progressive", "pyramid+layerwise"],
                        help="modes compared in (c)/(d); none first (the ratios are against it)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["a", "b", "c", "d", "e"],
                        help="parts to skip (d: part (c) with 16 distinct prompts; e: one prompt's time "
                        "to the first token per mode)")
    parser.add_argument("--batched-tokens", type=int, default=None,
                        help="the engine's max_num_batched_tokens in (c) and (d) (default: the engine's)")
    parser.add_argument("--runs", type=int, default=5, help="runs per mode in (e)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of (c) and (d): the modes alternate in one engine, each round's ratio "
                        "against that round's exact mode; the median round is reported")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    result: dict[str, Any] = {"benchmark": "kv_compression", "machine": {"cpus": os.cpu_count(),
                              "platform": platform.platform()}, "load_avg_before": os.getloadavg(),
                              "window": args.window, "chunk": args.chunk}
    engine = LLMEngine.launch(EngineConfig(kv_cache_memory_gib=1.0, seed=0, num_threads=args.threads,
                                           kv_window=args.window, speculative_tokens=0))
    tok = engine.tokenizer
    docs = documents(tok)
    bytes_per_block = engine.layout.bytes_per_block
    try:
        if "a" not in args.skip:
            result["kv_held"] = kv_held(engine, docs, args.sizes, args.computed_sizes)
        if "b" not in args.skip:
            result["perplexity"] = perplexity(engine, docs, args.retentions, args.pools, args.continuation,
                                              args.window, args.docs, args.throughput_retention, args.chunk)
        if "e" not in args.skip:
            result["prefill_time"] = prefill_time(engine, docs, args.runs, args.chunk)
    finally:
        engine.shutdown()
    if "c" not in args.skip:
        result["throughput"] = throughput(docs, args.tokens, args.throughput_retention, args.window,
                                          args.threads, bytes_per_block, distinct=False, modes=args.modes,
                                          chunk=args.chunk, batched_tokens=args.batched_tokens, rounds=args.rounds)
    if "d" not in args.skip:
        result["throughput_distinct"] = throughput(docs, args.tokens, args.throughput_retention, args.window,
                                                   args.threads, bytes_per_block, distinct=True,
                                                   modes=args.modes, chunk=args.chunk,
                                                   batched_tokens=args.batched_tokens, rounds=args.rounds)
    result["load_avg_after"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print("\n| part | setting | figure | vs exact |\n|---|---|---|---|")
    for row in result.get("kv_held", []):
        print(f"| a | {row['prompt_tokens']} tokens | {row['compressed_blocks']} / {row['exact_blocks']} blocks "
              f"({row['compressed_mib']:.1f} / {row['exact_mib']:.1f} MiB) | {row['ratio']:.3f}x |")
    for row in result.get("perplexity", {}).get("rows", []):
        print(f"| b | {row['setting']} | ppl {row['ppl']:.3f} | {row['ppl_ratio']:.3f}x |")
    for mode, row in result.get("prefill_time", {}).items():
        print(f"| e | {mode}, one {CONTEXT}-token prompt, first token (median) | {row['median_s']:.3f} s | "
              f"{row['ratio']:.2f}x |")
    for key in ("throughput", "throughput_distinct"):
        t = result.get(key)
        if not t:
            continue
        for mode in args.modes:
            print(f"| c | {mode}, {t['streams']} streams ({t['prompts']}), pool {t['pool_blocks']} blocks | "
                  f"{t[mode]['tokens_per_s']:.2f} tok/s ({t[mode]['wall_s']:.0f} s, {t[mode]['compressed']} "
                  f"compressed, {t[mode]['preemptions']} preempted, running {t[mode]['running_mean']:.1f} "
                  f"(max {t[mode]['running_max']})) | {t[mode]['ratio']:.2f}x"
                  + (f" (median of {t['rounds']} rounds: {', '.join(f'{r:.2f}x' for r in t[mode]['round_ratios'])})"
                     if t["rounds"] > 1 else "") + " |")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
