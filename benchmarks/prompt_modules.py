"""Prompt modules (issue 21): TTFT and quality of KV assembled from modules, bundled model.

A synthetic RAG workload from real text on this machine: documents of ~256 tokens
cut from the license texts under /usr/share/common-licenses, each a prompt module
(``doc<i>``). A prompt is the bundled model's chat template: a system turn, then a
user turn holding ``--docs`` documents in random order and a question, then the
assistant header. Segments: the head (system turn and user header: the modules'
anchor), one module per document, the question with the template's tail.

Per prompt, on one run, interleaved:

* full prefill (cold): the prompt under a cache salt of its own (nothing to hit:
  every token computed), on the same engine and thread as the others;
* exact-prefix caching: the same prompt as a plain request on the caching engine
  (which has seen earlier prompts: it hits whatever prefix they share);
* per recovery mode (none, epic, cacheblend): the prompt as a SegmentedPrompt on
  the caching engine, whose module blocks were encoded once before the
  measurements (a module encoded on first use costs its tokens once).

TTFT is the engine's own (arrival to first token). Quality against full prefill:
the first generated token equal, the 32 greedy tokens equal (the fraction of
positions equal up to the first difference, and whether all are), and the mean
KL divergence KL(full || mode) of the first output distribution (full vocabulary,
float32); and how many first-token misses fall on near-ties (full prefill's top two
logits at most NEAR_TIE apart). With ``--fp32-reference`` every prompt's full prefill
runs again on a float32 engine after the timed pass: how often bfloat16 full prefill
keeps float32's first token (the reference's own numerical noise), and each mode's
first token against float32's. Prints a table, writes benchmarks/results/prompt_modules.json.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/prompt_modules.py [--prompts 100] [--docs 4]
       [--pool 8] [--modes none epic cacheblend] [--anchor] [--fp32-reference]
Issue targets: --docs 4 (~1k tokens): TTFT >= 10x faster than full prefill; --docs 16
--pool 16 (~4k tokens): >= 20x; the default recovery's first token equal in >= 95% of 100 prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from engine.config import EngineConfig
from engine.core import assembly
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.promptcache.segments import Recovery, Segment, SegmentedPrompt

RESULTS = Path(__file__).resolve().parent / "results" / "prompt_modules.json"
LICENSES = Path("/usr/share/common-licenses")
DOC_TOKENS = 256
OUTPUT_TOKENS = 32
NEAR_TIE = 0.25
"""A full prefill whose top two first-token logits are at most this far apart (two
bfloat16 rounding steps at the bundled model's logits of 16-32) is a near-tie,
counted with the misses: any approximation of the KV flips many of them."""
QUESTIONS = [
    "Which of these texts allow redistribution, and under which conditions?",
    "Summarize what the documents say about warranty.",
    "What does the text say about modified versions?",
    "Name one obligation a distributor has.",
    "Is patent use mentioned? Answer briefly.",
    "Which document is the most permissive?",
    "What must be kept when copying the software?",
    "Explain the word 'copyleft' using these documents.",
]


def documents(tokenizer: Any, count: int) -> list[str]:
    """``count`` texts of about DOC_TOKENS tokens, cut at paragraph ends from the license files."""
    docs: list[str] = []
    for path in sorted(p for p in LICENSES.iterdir() if p.is_file()):
        text = path.read_text(errors="replace")
        current: list[str] = []
        for para in (p.strip() for p in text.split("\n\n")):
            if not para:
                continue
            current.append(" ".join(para.split()))
            n = len(tokenizer.encode("\n\n".join(current), add_special_tokens=False))
            if n >= DOC_TOKENS - 40:
                ids = tokenizer.encode("\n\n".join(current), add_special_tokens=False)[:DOC_TOKENS]
                docs.append(f"[{path.name}] " + tokenizer.decode(ids))
                current = []
                if len(docs) == count:
                    return docs
    raise SystemExit(f"only {len(docs)} documents of ~{DOC_TOKENS} tokens under {LICENSES}")


def template_parts(tokenizer: Any) -> tuple[str, str]:
    """The chat template rendered around the user's content: (head, tail)."""
    marker = "\x00CONTENT\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(marker)
    return head, tail


def build(tokenizer: Any, docs: list[str], order: list[int], question: str, rec: Recovery) -> SegmentedPrompt:
    head, tail = template_parts(tokenizer)
    enc = lambda s: tuple(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    segs = [Segment(enc(head))]
    segs += [Segment(enc(docs[i] + "\n\n"), f"doc{i}") for i in order]
    segs.append(Segment(enc(f"Question: {question}" + tail)))
    return SegmentedPrompt(tuple(segs), rec)


class Probe:
    """The engine's TTFT and first logits of each request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ttft: float | None = None
        self.logits: torch.Tensor | None = None
        engine.add_ttft_observer(self._ttft)
        engine.first_logits_observer = self._logits

    def _ttft(self, seconds: float) -> None:
        self.ttft = seconds

    def _logits(self, rid: str, row: torch.Tensor) -> None:
        self.logits = row.float().clone()


def generate(engine: LLMEngine, probe: Probe, rid: str, sp: SegmentedPrompt, segmented: bool,
             max_tokens: int, salt: str | None = None) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    probe.ttft = probe.logits = None
    req = GenerationRequest(rid, sp.token_ids, params, cache_salt=salt, segmented=sp if segmented else None)
    outs = engine.submit(req).result(timeout=900)
    assert outs[-1].error is None and probe.ttft is not None, outs[-1]
    return {"ttft": probe.ttft, "tokens": [t for o in outs for t in o.new_token_ids],
            "cached": outs[-1].num_cached_tokens, "logits": probe.logits}


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits, -1)
    q = torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum())


def agreement(a: list[int], b: list[int]) -> float:
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return same / len(a)


def fp32_reference(args: argparse.Namespace, rows: list[dict[str, Any]], docs: list[str],
                   recoveries: dict[str, Recovery]) -> None:
    """Each row's full prefill again on a float32 engine (after the bfloat16 one stopped:
    one OpenMP pool at a time); adds ``fp32_first`` and ``fp32_margin`` to each row."""
    engine = LLMEngine.launch(EngineConfig(kv_cache_memory_gib=1.0, num_threads=args.threads, seed=0,
                                           dtype="float32"))
    probe = Probe(engine)
    rec = next(iter(recoveries.values()))
    try:
        for i, row in enumerate(rows):
            sp = build(engine.tokenizer, docs, row["order"], row["question"], rec)
            got = generate(engine, probe, f"fp32-{i}", sp, False, 1, salt=f"fp32-{i}")
            top2 = torch.topk(got["logits"], 2).values
            row["fp32_first"] = got["tokens"][0]
            row["fp32_margin"] = float(top2[0] - top2[1])
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--docs", type=int, default=4, help="documents per prompt")
    parser.add_argument("--pool", type=int, default=8, help="documents to choose from")
    parser.add_argument("--modes", nargs="*", default=["none", "epic", "cacheblend"],
                        help="recovery modes, optionally with their parameter: epic:32, epic:16/8 (first/last "
                             "tokens of each module), cacheblend:0.3")
    parser.add_argument("--first-tokens", type=int, default=16, help="epic: tokens recomputed per module")
    parser.add_argument("--fraction", type=float, default=0.1, help="cacheblend: fraction recomputed")
    parser.add_argument("--anchor", action="store_true",
                        help="encode modules after the prompt's head (default: at position 0, alone)")
    parser.add_argument("--fp32-reference", action="store_true",
                        help="after the timed pass, run every prompt's full prefill again on a float32 engine: "
                             "how often bfloat16 full prefill itself keeps float32's first token (the reference's "
                             "own noise), and each mode's first token against float32's")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.anchor:
        assembly.ANCHOR_MAX_TOKENS = 64

    config = EngineConfig(kv_cache_memory_gib=1.0, num_threads=args.threads, seed=0)
    cached = LLMEngine.launch(config)  # one thread loads and runs (docs/engine.md: one OpenMP pool)
    probe = Probe(cached)
    tok = cached.tokenizer
    docs = documents(tok, args.pool)
    rng = random.Random(0)
    recoveries = {}
    for spec in args.modes:
        mode, _, param = spec.partition(":")
        first, _, last = param.partition("/")
        recoveries[spec] = Recovery(mode=mode, first_tokens=int(first) if first and mode == "epic" else args.first_tokens,
                                    fraction=float(param) if param and mode == "cacheblend" else args.fraction,
                                    last_tokens=int(last) if last and mode == "epic" else 0)
    rows: list[dict[str, Any]] = []
    try:
        # Encode every module once (a prompt with all documents, each mode's request would
        # reuse them): what a deployment holds after the first requests.
        warm = build(tok, docs, list(range(args.pool)), "Warm-up.", recoveries[args.modes[0]])
        generate(cached, probe, "warm", warm, True, 1)
        generate(cached, probe, "warm-full", warm, False, 1, salt="warm-full")
        for i in range(args.prompts):
            order = rng.sample(range(args.pool), args.docs)
            question = f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"
            sp = build(tok, docs, order, question, recoveries[args.modes[0]])
            full = generate(cached, probe, f"full-{i}", sp, False, OUTPUT_TOKENS, salt=f"full-{i}")
            exact = generate(cached, probe, f"exact-{i}", sp, False, 1)
            top2 = torch.topk(full["logits"], 2).values
            top2_ids = torch.topk(full["logits"], 2).indices.tolist()
            row: dict[str, Any] = {"prompt_tokens": len(sp.token_ids), "order": order, "question": question,
                                   "full_first": full["tokens"][0],
                                   "full_top2": [tok.decode([t]) for t in top2_ids],
                                   "full_margin": float(top2[0] - top2[1]),
                                   "full_ms": full["ttft"] * 1e3, "exact_ms": exact["ttft"] * 1e3,
                                   "exact_cached": exact["cached"], "modes": {}}
            for mode, rec in recoveries.items():
                spm = SegmentedPrompt(sp.segments, rec)
                got = generate(cached, probe, f"{mode}-{i}", spm, True, OUTPUT_TOKENS)
                row["modes"][mode] = {
                    "ms": got["ttft"] * 1e3, "cached": got["cached"], "first_token": got["tokens"][0],
                    "first_equal": got["tokens"][0] == full["tokens"][0],
                    "all_equal": got["tokens"] == full["tokens"],
                    "agreement": agreement(got["tokens"], full["tokens"]),
                    "kl": kl(full["logits"], got["logits"]),
                }
            rows.append(row)
            print(f"prompt {i}: {row['prompt_tokens']} tokens, full {row['full_ms']:.0f} ms, exact "
                  f"{row['exact_ms']:.0f} ms, " + ", ".join(
                      f"{m} {r['ms']:.0f} ms {'=' if r['first_equal'] else 'x'}" for m, r in row["modes"].items()),
                  flush=True)
        stats = cached.stats()
    finally:
        cached.shutdown()
    if args.fp32_reference:
        fp32_reference(args, rows, docs, recoveries)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    full_ms = med([r["full_ms"] for r in rows])
    exact_ms = med([r["exact_ms"] for r in rows])
    summary: dict[str, Any] = {}
    for mode in args.modes:
        per = [r["modes"][mode] for r in rows]
        ms = med([p["ms"] for p in per])
        summary[mode] = {
            "ttft_ms": ms, "speedup_vs_full": full_ms / ms, "speedup_vs_exact": exact_ms / ms,
            "speedup_vs_full_per_prompt_median": med([r["full_ms"] / r["modes"][mode]["ms"] for r in rows]),
            "cached_tokens": med([p["cached"] for p in per]),
            "first_token_agreement": sum(p["first_equal"] for p in per) / len(per),
            "greedy32_all_equal": sum(p["all_equal"] for p in per) / len(per),
            "greedy32_agreement": statistics.mean(p["agreement"] for p in per),
            "mean_kl": statistics.mean(p["kl"] for p in per),
            "first_token_misses_at_near_ties": sum(1 for r in rows if not r["modes"][mode]["first_equal"]
                                                   and r["full_margin"] <= NEAR_TIE),
        }
    tokens = med([r["prompt_tokens"] for r in rows])
    print(f"\nprompt modules: {len(rows)} prompts of {args.docs} documents (~{tokens:.0f} tokens), "
          f"anchor={'on' if args.anchor else 'off'}, threads={torch.get_num_threads()}")
    print(f"full prefill (cold) TTFT {full_ms:.1f} ms; exact-prefix caching {exact_ms:.1f} ms "
          f"(median cached {med([r['exact_cached'] for r in rows]):.0f} tokens)")
    print(f"{'recovery':>14} {'TTFT ms':>8} {'vs full':>8} {'vs exact':>9} {'cached':>7} {'1st tok':>8} "
          f"{'32 equal':>9} {'32 agree':>9} {'mean KL':>8} {'misses at near-ties':>20}")
    for mode, s in summary.items():
        misses = round((1 - s["first_token_agreement"]) * len(rows))
        print(f"{mode:>14} {s['ttft_ms']:>8.1f} {s['speedup_vs_full']:>7.1f}x {s['speedup_vs_exact']:>8.1f}x "
              f"{s['cached_tokens']:>7.0f} {s['first_token_agreement']:>8.0%} {s['greedy32_all_equal']:>9.0%} "
              f"{s['greedy32_agreement']:>9.2f} {s['mean_kl']:>8.4f} "
              f"{s['first_token_misses_at_near_ties']:>14} of {misses:<3}")
    if args.fp32_reference:
        same = sum(r["full_first"] == r["fp32_first"] for r in rows)
        print(f"float32 reference: bfloat16 full prefill keeps float32's first token in {same} of {len(rows)} "
              "prompts; per mode: " + ", ".join(
                  f"{m} {sum(r['modes'][m]['first_token'] == r['fp32_first'] for r in rows)}" for m in args.modes))
        for mode in args.modes:
            summary[mode]["first_token_agreement_fp32_reference"] = sum(
                r["modes"][mode]["first_token"] == r["fp32_first"] for r in rows) / len(rows)
        summary["bf16_full_vs_fp32_full_first_token"] = same / len(rows)
    near = sum(1 for r in rows if r["full_margin"] <= NEAR_TIE)
    print(f"near-ties (full prefill's top-2 logit gap <= {NEAR_TIE}): {near} of {len(rows)} prompts")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "prompt_modules", "prompts": len(rows), "docs_per_prompt": args.docs, "pool": args.pool,
        "anchor": args.anchor, "first_tokens": args.first_tokens, "fraction": args.fraction,
        "prompt_tokens_median": tokens, "near_tie": NEAR_TIE, "full_ms": full_ms, "exact_ms": exact_ms,
        "summary": summary,
        "module_blocks": stats.module_blocks, "module_tokens_reused": stats.module_tokens_reused,
        "threads": torch.get_num_threads(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "rows": rows,
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
