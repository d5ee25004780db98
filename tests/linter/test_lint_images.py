"""Images in the linter: identity by content hash (or bytes without Pillow), token estimate, PS207."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from engine.contract.image_content import content_hash
from linter.api import compare_requests
from linter.image_parts import UNKNOWN_SIZE_TOKENS, estimate_tokens, image_part
from linter.render import render
from linter.tokenizer import ApproxTokenizer

ROOT = Path(__file__).resolve().parents[2]


def picture(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    image = Image.new("RGB", size)
    image.putdata([((x * 31 + seed * 13) % 256, (y * 17 + seed) % 256, (x + y * seed) % 256)
                   for y in range(size[1]) for x in range(size[0])])
    return image


def data_url(image: Image.Image, fmt: str = "PNG", **params: object) -> str:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def part(url: str, detail: str | None = None) -> dict:
    spec = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": spec}


@pytest.mark.parametrize(("size", "detail", "tokens"), [
    ((1024, 1024), None, 765),      # OpenAI's worked examples
    ((2048, 4096), "high", 1105),
    ((4096, 8192), "auto", 1105),   # fit in 2048 first
    ((100, 100), None, 255),        # never scaled up: one tile
    ((4000, 3000), "low", 85),
    (None, None, UNKNOWN_SIZE_TOKENS),
])
def test_token_estimate_follows_the_tile_formula(size, detail, tokens):
    assert estimate_tokens(size, detail) == tokens


def test_a_data_url_is_named_by_the_engines_content_hash():
    pic = picture(1)
    found = image_part(part(data_url(pic)))
    assert found is not None and found.exact and found.size == (40, 30)
    assert found.identity == content_hash(pic)
    webp = image_part(part(data_url(pic, "WEBP", lossless=True)))
    assert webp is not None and webp.identity == found.identity
    assert image_part({"type": "input_image", "image_url": data_url(pic), "detail": "low"}).tokens == 85


def test_remote_and_broken_images_have_inexact_identities():
    remote = image_part(part("https://cdn.example/p.jpg"))
    assert remote is not None and not remote.exact and remote.identity == "url:https://cdn.example/p.jpg"
    assert remote.tokens == UNKNOWN_SIZE_TOKENS
    broken = image_part(part("data:image/png;base64,@@@"))
    assert broken is not None and broken.identity.startswith("invalid:")
    assert image_part({"type": "text", "text": "x"}) is None


def test_an_image_renders_to_about_its_estimated_tokens():
    url = data_url(picture(2, (1024, 1024)))
    rendered = render({"messages": [{"role": "user", "content": [part(url)]}]})
    (index,) = [i for i, kind in enumerate(rendered.kinds) if kind == "image"]
    assert rendered.locations[index] == "messages[0].content[0]"
    count = len(ApproxTokenizer().encode(rendered.parts[index]))
    assert abs(count - 765) <= 6


def turns(first_image: str, second_image: str) -> tuple[dict, dict]:
    text = {"type": "text", "text": "What is in this picture? Describe it in detail, please."}
    previous = {"model": "m", "messages": [{"role": "user", "content": [text, part(first_image)]}]}
    current = {"model": "m", "messages": [{"role": "user", "content": [text, part(second_image)]},
                                          {"role": "assistant", "content": "Stripes."},
                                          {"role": "user", "content": "Which colours?"}]}
    return previous, current


def test_another_image_loses_the_tokens_from_the_image_on():
    previous, current = turns(data_url(picture(1)), data_url(picture(2)))
    (finding,) = compare_requests(previous, current, same_conversation=True)
    assert finding.code == "PS207" and finding.location == "messages[0].content[1]"
    image_tokens = estimate_tokens((40, 30))
    assert finding.tokens_lost >= image_tokens - 16
    assert compare_requests(*turns(data_url(picture(1)), data_url(picture(1))), same_conversation=True) == []


def test_a_shared_prompt_cache_key_does_not_report_other_conversations_images():
    previous, current = turns(data_url(picture(1)), data_url(picture(2)))
    assert compare_requests(previous, current, same_conversation=True, edits=False) == []


def test_without_pillow_images_are_compared_by_their_bytes():
    """The documented limitation: re-encoded pixels count as another image, other images still do."""
    pic = picture(3)
    same_pixels = turns(data_url(pic), data_url(pic, "WEBP", lossless=True))
    other = turns(data_url(pic), data_url(picture(4)))
    code = (
        "import json, sys\n"
        "sys.modules['PIL'] = None\n"
        "from linter.api import compare_requests\n"
        "from linter.image_parts import image_part\n"
        "cases = json.loads(sys.stdin.read())\n"
        "found = [[f.code for f in compare_requests(p, c, same_conversation=True)] for p, c in cases]\n"
        "ident = image_part(cases[0][0]['messages'][0]['content'][1])\n"
        "print(json.dumps([found, ident.exact, ident.identity[:6]]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps([same_pixels, other]), text=True,
                         capture_output=True, check=True, cwd=ROOT).stdout
    assert json.loads(out) == [[["PS207"], ["PS207"]], False, "bytes:"]


def test_pictures_past_the_decoding_bound_are_named_by_their_bytes_without_decoding(monkeypatch):
    import linter.image_parts as image_parts

    monkeypatch.setattr(image_parts, "MAX_DECODED_PIXELS", 40 * 30 - 1)
    monkeypatch.setattr(image_parts, "_memo", type(image_parts._memo)())
    found = image_part(part(data_url(picture(6))))
    assert found is not None and not found.exact and found.identity.startswith("bytes:")
