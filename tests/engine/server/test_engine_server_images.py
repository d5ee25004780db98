"""engine.contract.images and engine.contract.image_content: verified decoding, a content hash over pixels and shape."""

import base64
import struct
import zlib

import pytest
from image_samples import data_url, encode, picture, png
from PIL import Image

from engine.contract.image_content import (
    MAX_IMAGE_PIXELS,
    content_hash,
    decode_image,
    image_identity,
)
from engine.contract.images import MAX_IMAGE_BYTES, ImageData, decode_data_url, load_image

PNG_BYTES = png()


def with_ihdr_size(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims another size (CRC fixed), to test size checks without the memory."""
    assert data[12:16] == b"IHDR"
    body = struct.pack(">II", width, height) + data[24:29]
    return data[:16] + body + struct.pack(">I", zlib.crc32(b"IHDR" + body)) + data[33:]


def test_data_url_is_decoded_into_a_verified_image_named_by_its_content():
    image = decode_data_url(data_url(PNG_BYTES))
    assert image.data == PNG_BYTES
    assert image.media_type == "image/png"
    assert isinstance(image.image, Image.Image)
    assert image.image.size == (8, 6)
    assert image.sha256 == content_hash(image.image)
    assert len(image.sha256) == 64


def test_line_wrapping_of_the_base64_does_not_change_the_identifier():
    encoded = base64.b64encode(PNG_BYTES).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    a = decode_data_url(data_url(PNG_BYTES))
    b = decode_data_url(f"data:image/png;base64,{wrapped}")
    assert a.sha256 == b.sha256


def test_the_same_pixels_as_png_and_as_lossless_webp_hash_alike():
    pic = picture(9, 5, seed=3)
    as_png, as_webp = encode(pic, "PNG"), encode(pic, "WEBP", lossless=True)
    assert as_png != as_webp
    a, b = ImageData.from_bytes(as_png), ImageData.from_bytes(as_webp)
    assert (a.media_type, b.media_type) == ("image/png", "image/webp")
    assert a.sha256 == b.sha256


def test_a_palette_png_and_an_rgb_png_of_the_same_pixels_hash_alike():
    pic = picture(6, 6, seed=1).quantize(colors=16).convert("RGB")
    palette = pic.quantize(colors=16)
    assert palette.mode == "P" and palette.convert("RGB").tobytes() == pic.tobytes()
    assert ImageData.from_bytes(encode(palette)).sha256 == ImageData.from_bytes(encode(pic)).sha256


def test_equal_raw_bytes_in_different_shapes_never_collide():
    """CVE-2025-46722: a hash of the pixel bytes alone would make these two images one."""
    wide = picture(8, 2, seed=4)
    square = Image.frombytes("RGB", (4, 4), wide.tobytes())
    assert wide.tobytes() == square.tobytes()
    assert ImageData.from_bytes(encode(wide)).sha256 != ImageData.from_bytes(encode(square)).sha256


def test_one_changed_pixel_changes_the_hash():
    pic = picture(8, 8, seed=2)
    changed = pic.copy()
    changed.putpixel((7, 7), (0, 0, 0) if pic.getpixel((7, 7)) != (0, 0, 0) else (1, 1, 1))
    assert ImageData.from_bytes(encode(pic)).sha256 != ImageData.from_bytes(encode(changed)).sha256


def test_sixteen_bit_images_are_hashed_without_losing_their_low_bits():
    a = Image.new("I;16", (4, 4), 0x1200)
    b = Image.new("I;16", (4, 4), 0x1201)
    assert a.convert("RGBA").tobytes() == b.convert("RGBA").tobytes()  # a lossy view would collide
    assert ImageData.from_bytes(encode(a)).sha256 != ImageData.from_bytes(encode(b)).sha256


def test_jpeg_is_decoded_and_hashed():
    image = ImageData.from_bytes(encode(picture(16, 16), "JPEG", quality=90))
    assert image.media_type == "image/jpeg" and image.image.size == (16, 16)


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF", "ICO"])
def test_other_formats_are_refused(fmt):
    with pytest.raises(ValueError, match="PNG, JPEG, WEBP"):
        ImageData.from_bytes(encode(picture(8, 8), fmt))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_files_are_refused(fmt):
    data = encode(picture(64, 64, seed=5), fmt)
    with pytest.raises(ValueError):
        ImageData.from_bytes(data[: len(data) // 2])


def test_too_many_pixels_are_refused_before_decoding():
    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    with pytest.raises(ValueError, match="pixels"):
        decode_image(with_ihdr_size(PNG_BYTES, side, side))
    with pytest.raises(ValueError, match="too many pixels"):  # past Pillow's own bomb threshold too
        decode_image(with_ihdr_size(PNG_BYTES, 60_000, 60_000))


def test_zero_size_is_refused():
    with pytest.raises(ValueError):
        decode_image(with_ihdr_size(PNG_BYTES, 0, 6))


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_animated_images_are_refused(fmt):
    frames = [picture(8, 8, seed=i) for i in range(2)]
    data = encode(frames[0], fmt, save_all=True, append_images=frames[1:], lossless=True)
    with pytest.raises(ValueError, match="animated"):
        decode_image(data)


def test_garbage_behind_an_image_media_type_is_refused():
    with pytest.raises(ValueError):
        decode_data_url(data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256))))


def test_image_identity_is_the_content_hash_or_says_it_is_only_a_byte_hash():
    exact = image_identity(PNG_BYTES)
    assert exact.exact and exact.value == ImageData.from_bytes(PNG_BYTES).sha256
    fallback = image_identity(b"not an image")
    assert not fallback.exact and fallback.value.startswith("bytes:")


def test_different_pictures_get_different_identifiers():
    assert decode_data_url(data_url(png(seed=1))).sha256 != decode_data_url(data_url(png(seed=2))).sha256


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("data:image/png,notbase64", "base64"),
        ("data:image/png;base64", "','"),
        ("data:text/plain;base64,aGVsbG8=", "image/*"),
        ("data:image/png;base64,@@@@", "not valid base64"),
        ("data:image/png;base64,", "empty"),
    ],
)
def test_malformed_data_urls_raise_value_error_saying_why(url, fragment):
    with pytest.raises(ValueError, match=fragment):
        decode_data_url(url)


def test_oversized_image_is_refused():
    with pytest.raises(ValueError, match="limit"):
        ImageData.from_bytes(b"x" * (MAX_IMAGE_BYTES + 1))


def test_remote_urls_are_refused_by_default_and_never_fetched():
    calls = []
    with pytest.raises(ValueError, match="allowed-media-domains"):
        load_image("https://example.com/cat.png", allow_remote=False, fetch=calls.append)
    assert calls == []


def test_remote_urls_go_through_the_given_fetcher_only_when_allowed():
    fetched = []

    def fetch(url: str) -> bytes:
        fetched.append(url)
        return PNG_BYTES

    image = load_image("https://example.com/cat.png", allow_remote=True, fetch=fetch)
    assert fetched == ["https://example.com/cat.png"]
    assert image.sha256 == ImageData.from_bytes(PNG_BYTES).sha256


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/y.png", "cat.png", "", None, 3])
def test_other_schemes_and_non_strings_are_refused(url):
    with pytest.raises(ValueError):
        load_image(url, allow_remote=True, fetch=lambda u: b"x")


def test_importing_the_image_modules_and_the_gateway_does_not_import_pillow():
    import subprocess
    import sys

    code = ("import sys, engine.contract.image_content, engine.contract.images, engine.contract.chat, gateway.routing.block_keys, "
            "gateway.server.app, linter.api, linter.render; "
            "sys.exit('PIL' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def _whole_image_hash(image):
    """content_hash's definition, computed on the whole image at once (the reference)."""
    import hashlib

    from engine.contract.image_content import HASH_VERSION, canonical_mode

    mode = canonical_mode(image.mode)
    pixels = image if image.mode == mode else image.convert(mode)
    digest = hashlib.sha256(HASH_VERSION + f"{mode},{image.width},{image.height}".encode() + b"\0")
    digest.update(pixels.tobytes())
    return digest.hexdigest()


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "PA", "RGB", "RGBA", "I;16", "CMYK", "F"])
def test_hashing_in_strips_gives_the_whole_image_hash(mode, monkeypatch):
    import numpy as np

    import engine.contract.image_content as image_content

    rng = np.random.RandomState(7)
    image = Image.fromarray(rng.randint(0, 256, (37, 29, 4), dtype=np.uint8), "RGBA").convert(mode)
    if mode == "P":
        image.info["transparency"] = 3
    expected = _whole_image_hash(image)
    for strip_bytes in (1, 4 * 29 * 5, 10**9):  # one row, five rows, the whole image at a time
        monkeypatch.setattr(image_content, "HASH_STRIP_BYTES", strip_bytes)
        assert content_hash(image) == expected


def test_image_pixels_reads_the_header_only_and_refuses_what_decoding_refuses():
    from engine.contract.image_content import image_pixels

    assert image_pixels(png(5, 3)) == 15
    with pytest.raises(ValueError, match="pixels"):
        image_pixels(encode(Image.new("1", (MAX_IMAGE_PIXELS // 1000 + 1, 1000))))
    with pytest.raises(ValueError, match="Pillow can read"):
        image_pixels(b"not an image")
