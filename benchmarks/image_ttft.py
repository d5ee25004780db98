"""TTFT with a repeated image vs a new image, on tiny random vision-language models.

For each architecture (a tiny LLaVA and a tiny Idefics3, built into a temporary
directory by ``tests/engine/multimodal/tiny_vlm.py``; ``--image-size`` sets the
pictures' side, Idefics3 tiles larger ones), three kinds of request, interleaved
run by run in one process on one caching engine, each generating one token:

* new: a picture never seen before (vision tower + full prefill);
* repeated: the same picture and text as an earlier request (the prefix cache
  holds every block of the image; the vision tower is not run);
* repeated image, new text: the same picture after a new first line (no block of
  the image is reusable since the text before it differs, but the encoder cache
  holds its features: prefill without the vision tower).

TTFT is the engine's own measurement (arrival to first sampled token); the vision
tower alone on one picture is timed too (engine stopped). Prints a
table of medians and writes benchmarks/results/image_ttft.json. The models are
random and tiny, so the figures show the mechanism's relative effect on this
machine, not what a real checkpoint costs.

Usage: .venv/bin/python benchmarks/image_ttft.py [--runs 7] [--image-size 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engine" / "multimodal"))

import numpy as np
import torch
from PIL import Image
from tiny_vlm import build_tiny_idefics3, build_tiny_llava

from engine.config import EngineConfig
from engine.contract.chat import ChatRenderer
from engine.core.llm_engine import GenerationRequest, LLMEngine, SamplingParams
from engine.model_store import ensure_converted_model

RESULTS = Path(__file__).resolve().parent / "results" / "image_ttft.json"
KINDS = ("new", "repeated", "repeated_image_new_text")


def picture(seed: int, side: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8))


def messages(image: Image.Image, first_line: str) -> list[dict[str, Any]]:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return [{"role": "user", "content": [{"type": "text", "text": first_line},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


class Timer:
    """The engine's own TTFT of the last request (observer called in the loop thread)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.last = 0.0
        engine.add_ttft_observer(self._observe)

    def _observe(self, seconds: float) -> None:
        self.last = seconds


def bench_arch(name: str, model_dir: Path, runs: int, side: int, threads: int | None) -> dict[str, Any]:
    engine = LLMEngine.from_config(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory_gib=0.05,
                                                num_threads=threads, seed=0, served_model_name=name))
    renderer = ChatRenderer(engine.tokenizer, image_processor=engine.image_processor)
    timer = Timer(engine)
    engine.start()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cached: dict[str, list[int]] = {k: [] for k in KINDS}
    outputs: dict[str, list[list[int]]] = {k: [] for k in KINDS}
    n = 0

    def one(kind: str, image: Image.Image, first_line: str) -> None:
        nonlocal n
        prompt = renderer.render(messages(image, first_line))
        n += 1
        req = GenerationRequest(f"{kind}-{n}", prompt.token_ids, SamplingParams(max_tokens=1, temperature=0.0),
                                mm_items=prompt.mm_items, mm_inputs=prompt.mm_inputs)
        out = engine.submit(req).result(timeout=300)
        times[kind].append(timer.last * 1000)
        cached[kind].append(out[-1].num_cached_tokens)
        outputs[kind].append([t for o in out for t in o.new_token_ids])

    try:
        one("new", picture(10_000, side), "Warm-up: what is this?")
        for run in range(runs):
            image = picture(run, side)
            one("new", image, "What is in this picture?")
            one("repeated", image, "What is in this picture?")
            one("repeated_image_new_text", image, f"Question {run}: what is in this picture?")
        sample = renderer.render(messages(picture(0, side), "What is in this picture?"))
        prompt_tokens = len(sample.token_ids)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert engine.embedder is not None
    encode_ms = []
    for _ in range(runs):  # the vision tower alone, engine stopped: what a new image adds
        start = time.perf_counter()
        engine.embedder.encoder.encode(sample.mm_inputs[0].pixels)
        encode_ms.append((time.perf_counter() - start) * 1000)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "arch": name,
        "prompt_tokens": prompt_tokens,
        "median_ttft_ms": medians,
        "median_vision_tower_ms": statistics.median(encode_ms),
        "min_vision_tower_ms": min(encode_ms),
        "ttft_ms": times,
        "median_cached_tokens": {k: statistics.median(v) for k, v in cached.items()},
        "repeated_speedup": medians["new"] / medians["repeated"],
        "encoder_cache_speedup": medians["new"] / medians["repeated_image_new_text"],
        # run r's "new" request (after the warm-up) and its repeat must give the same token
        "identical_outputs_new_vs_repeated": outputs["new"][1:] == outputs["repeated"],
        "encoder_cache": {"hits": stats.encoder_cache_hits, "misses": stats.encoder_cache_misses},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--image-size", type=int, default=64, help="pictures' side in pixels (default: 64)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    tokenizer_dir = str(ensure_converted_model())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in (("tiny-llava", build_tiny_llava), ("tiny-idefics3", build_tiny_idefics3)):
            model_dir = build(tokenizer_dir, Path(tmp) / name)
            rows.append(bench_arch(name, model_dir, args.runs, args.image_size, args.threads))
    print(f"TTFT (one token), median of {args.runs} runs, {args.image_size}x{args.image_size} images, "
          f"float32, threads={torch.get_num_threads()}")
    print(f"{'model':<14} {'prompt':>6} {'new ms':>8} {'repeated ms':>11} {'cached':>6} {'same img new text ms':>20} "
          f"{'repeated x':>10} {'enc cache x':>11} {'vision ms':>9} {'(min)':>6}")
    for r in rows:
        m = r["median_ttft_ms"]
        print(f"{r['arch']:<14} {r['prompt_tokens']:>6} {m['new']:>8.2f} {m['repeated']:>11.2f} "
              f"{r['median_cached_tokens']['repeated']:>6.0f} {m['repeated_image_new_text']:>20.2f} "
              f"{r['repeated_speedup']:>9.2f}x {r['encoder_cache_speedup']:>10.2f}x "
              f"{r['median_vision_tower_ms']:>9.2f} {r['min_vision_tower_ms']:>6.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "benchmark": "image_ttft",
        "runs": args.runs,
        "image_size": args.image_size,
        "threads": torch.get_num_threads(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg": os.getloadavg()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }, indent=2))
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
