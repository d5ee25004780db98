"""Prompt modules (issue 21): how good can any selective recovery be on the bundled model?

An oracle study, not a measurement of the engine. For each prompt of
``benchmarks/prompt_modules.py`` (same documents, orders and questions) it builds, with
transformers' forward in float32 (no engine kernels, no bfloat16 rounding):

* the exact K/V of the prompt's context (head and documents), by full prefill;
* the modules' K/V as prompt modules give them: each document computed alone at its
  positions in this prompt (what re-rotation of a module encoded at 0 gives, without
  rounding), after the exact head;

then runs the question (and the chat template's tail) over caches mixing the two and
compares the first output distribution with full prefill's (first token equal, KL):

* ``none``: the modules' K/V as they are (Prompt Cache);
* ``hide_first1``: the same, but the question does not attend to each module's first
  token (which, computed alone, became an attention sink);
* ``exact_first{4,16}``: the first 4 or 16 tokens of every module given their *exact*
  K/V in every layer (the best EPIC could do with that many tokens);
* ``exact_top{P}``: the ``P``% of module tokens whose K/V deviate most from exact
  (summed over layers, keys and values each divided by its mean) given their exact K/V
  in every layer: the best any selective recompute of ``P``% could do (CacheBlend
  recomputes them from approximate context, so it gets at most this);
* ``exact_layers_lo`` / ``_hi``: every module token exact in the lower / upper half of
  the layers only.

Recomputing a token on a CPU costs what prefilling it costs, so ``exact_topP`` is
also a bound on quality at a TTFT of about ``P``% of full prefill.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmarks/prompt_modules_oracle.py [--prompts 30]
Prints a table, writes benchmarks/results/prompt_modules_oracle.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import prompt_modules as bench  # the workload: documents, orders, questions
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine.model_store import ensure_converted_model
from engine.promptcache.segments import Recovery

RESULTS = Path(__file__).resolve().parent / "results" / "prompt_modules_oracle.json"
TOP_PERCENTS = (5, 10, 20, 30, 45, 60)
KV = list[tuple[torch.Tensor, torch.Tensor]]


def forward(model: Any, ids: list[int], start: int, kv: KV | None = None,
            hidden: list[int] | None = None) -> tuple[torch.Tensor, KV]:
    """``ids`` at positions ``start ..`` after the cache ``kv`` (copied; positions in
    ``hidden`` masked out): the last row's float32 logits and the K/V of every layer."""
    cache = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv]) if kv else DynamicCache(
        config=model.config)
    past = kv[0][0].shape[2] if kv else 0
    mask = torch.ones(1, past + len(ids), dtype=torch.long)
    if hidden:
        mask[0, hidden] = 0
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([list(range(start, start + len(ids)))]),
                cache=cache, attention_mask=mask, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1].float(), [(layer.keys, layer.values) for layer in cache.layers]


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum())


def mixed(exact: KV, alone: KV, positions: list[int] | range = (), layers: range | tuple[int, ...] = ()) -> KV:
    """``alone``'s K/V with ``positions`` (in every layer) and whole ``layers`` exact."""
    index = torch.tensor(sorted(positions), dtype=torch.long)
    out: KV = []
    for i, ((ek, ev), (ak, av)) in enumerate(zip(exact, alone, strict=True)):
        if i in layers:
            out.append((ek, ev))
            continue
        k, v = ak.clone(), av.clone()
        if len(index):
            k[:, :, index], v[:, :, index] = ek[:, :, index], ev[:, :, index]
        out.append((k, v))
    return out


def study(model: Any, tok: Any, docs: list[str], order: list[int], question: str) -> dict[str, Any]:
    segs = bench.build(tok, docs, order, question, Recovery()).segments
    head, tail = list(segs[0].token_ids), list(segs[-1].token_ids)
    context = [t for s in segs[:-1] for t in s.token_ids]
    n = len(context)
    _, exact = forward(model, context, 0)
    full_logits, _ = forward(model, tail, n, exact)
    alone = [(k[:, :, : len(head)], v[:, :, : len(head)]) for k, v in exact]
    modules: list[tuple[int, int]] = []
    offset = len(head)
    for seg in segs[1:-1]:
        _, kv = forward(model, list(seg.token_ids), offset)
        alone = [(torch.cat([ak, k], 2), torch.cat([av, v], 2)) for (ak, av), (k, v) in zip(alone, kv, strict=True)]
        modules.append((offset, len(seg.token_ids)))
        offset += len(seg.token_ids)
    deviation = torch.zeros(n)
    for (ek, ev), (ak, av) in zip(exact, alone, strict=True):
        for d in ((ek - ak).square().sum((0, 1, 3)), (ev - av).square().sum((0, 1, 3))):
            deviation += d / d.mean().clamp_min(1e-12)
    module_positions = [p for o, m in modules for p in range(o, o + m)]
    ranked = sorted(module_positions, key=lambda p: (-float(deviation[p]), p))
    layers = len(exact)
    variants: dict[str, tuple[KV, list[int] | None]] = {
        "none": (alone, None),
        "hide_first1": (alone, [o for o, _ in modules]),
        "exact_first4": (mixed(exact, alone, [o + j for o, m in modules for j in range(min(4, m))]), None),
        "exact_first16": (mixed(exact, alone, [o + j for o, m in modules for j in range(min(16, m))]), None),
        **{f"exact_top{p}": (mixed(exact, alone, ranked[: p * len(ranked) // 100]), None) for p in TOP_PERCENTS},
        "exact_layers_lo": (mixed(exact, alone, layers=range(layers // 2)), None),
        "exact_layers_hi": (mixed(exact, alone, layers=range(layers // 2, layers)), None),
    }
    top2 = torch.topk(full_logits, 2).values
    row: dict[str, Any] = {"order": order, "question": question, "prompt_tokens": n + len(tail),
                           "full_margin": float(top2[0] - top2[1]), "variants": {}}
    for name, (kv, hidden) in variants.items():
        logits, _ = forward(model, tail, n, kv, hidden)
        row["variants"][name] = {"first_equal": int(logits.argmax()) == int(full_logits.argmax()),
                                 "kl": kl(full_logits, logits)}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--docs", type=int, default=4, help="documents per prompt")
    parser.add_argument("--pool", type=int, default=8, help="documents to choose from")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    directory = ensure_converted_model()  # the bundled model, converted once
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    docs = bench.documents(tok, args.pool)
    rng = random.Random(0)  # the orders and questions of benchmarks/prompt_modules.py
    rows = []
    with torch.inference_mode():
        for i in range(args.prompts):
            order = rng.sample(range(args.pool), args.docs)
            rows.append(study(model, tok, docs, order, f"{bench.QUESTIONS[i % len(bench.QUESTIONS)]} (#{i})"))
            print(f"prompt {i}: " + ", ".join(f"{k} {'=' if v['first_equal'] else 'x'} {v['kl']:.3f}"
                                              for k, v in rows[-1]["variants"].items()), flush=True)
    summary = {name: {"first_token_agreement": sum(r["variants"][name]["first_equal"] for r in rows) / len(rows),
                      "mean_kl": statistics.mean(r["variants"][name]["kl"] for r in rows)}
               for name in rows[0]["variants"]}
    print(f"\nprompt modules oracle: {len(rows)} prompts of {args.docs} documents "
          f"(~{statistics.median(r['prompt_tokens'] for r in rows):.0f} tokens), float32")
    print(f"{'variant':>16} {'1st tok':>8} {'mean KL':>8}")
    for name, s in summary.items():
        print(f"{name:>16} {s['first_token_agreement']:>8.0%} {s['mean_kl']:>8.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "prompt_modules_oracle", "prompts": len(rows), "dtype": "float32",
                                    "docs_per_prompt": args.docs, "pool": args.pool, "summary": summary,
                                    "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
