"""What naming an image by its content costs: decode + verify + content hash, per image.

For photo-like pictures (smooth gradients plus noise, so encoders cannot cheat) at
three sizes and in PNG, JPEG and lossless WebP, the median of ``--repeats`` runs of

* ``decode``: :func:`engine.contract.image_content.decode_image` (open, checks, full decode);
* ``hash``: :func:`engine.contract.image_content.content_hash` of the decoded image;
* ``bytes``: SHA256 of the encoded bytes (what the engine used before), for scale.

Same-run ratios only: the machine is shared and its speed drifts between runs.
Prints a table and writes JSON (default: benchmarks/results/image_hash.json).

    python benchmarks/image_hash.py [--repeats 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.contract.image_content import content_hash, decode_image  # noqa: E402

SIZES = ((512, 512), (1024, 1024), (2048, 2048), (4032, 3024))
FORMATS = (("PNG", {}), ("JPEG", {"quality": 90}), ("WEBP", {"lossless": True}))


def photo(size: tuple[int, int]) -> Image.Image:
    width, height = size
    gradient = Image.linear_gradient("L").resize(size)
    noise = Image.frombytes("L", size, random.Random(0).randbytes(width * height))
    return Image.merge("RGB", (gradient, gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT), noise))


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "image_hash.json")
    args = parser.parse_args()
    rows = []
    for size in SIZES:
        picture = photo(size)
        for fmt, params in FORMATS:
            out = io.BytesIO()
            picture.save(out, format=fmt, **params)
            data = out.getvalue()
            decoded = decode_image(data)
            rows.append({
                "size": f"{size[0]}x{size[1]}", "format": fmt, "encoded_kib": round(len(data) / 1024),
                "decode_ms": median_ms(lambda data=data: decode_image(data), args.repeats),
                "hash_ms": median_ms(lambda decoded=decoded: content_hash(decoded), args.repeats),
                "bytes_sha256_ms": median_ms(lambda data=data: hashlib.sha256(data).digest(), args.repeats),
            })
    print(f"{'size':>10} {'format':>6} {'KiB':>7} {'decode ms':>10} {'hash ms':>8} {'bytes-sha ms':>12}")
    for r in rows:
        print(f"{r['size']:>10} {r['format']:>6} {r['encoded_kib']:>7} {r['decode_ms']:>10.2f} "
              f"{r['hash_ms']:>8.2f} {r['bytes_sha256_ms']:>12.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                    "repeats": args.repeats, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
