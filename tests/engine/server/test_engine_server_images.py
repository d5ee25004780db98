"""engine.server.images: data: URLs decoded and SHA256-named; remote URLs refused unless allowed."""

import base64
import hashlib

import pytest

from engine.server.images import MAX_IMAGE_BYTES, ImageData, decode_data_url, load_image

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 3


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_url_is_decoded_and_named_by_the_sha256_of_its_bytes():
    image = decode_data_url(data_url(PNG_BYTES))
    assert image.data == PNG_BYTES
    assert image.media_type == "image/png"
    assert image.sha256 == hashlib.sha256(PNG_BYTES).hexdigest()


def test_line_wrapping_of_the_base64_does_not_change_the_identifier():
    encoded = base64.b64encode(PNG_BYTES).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    a = decode_data_url(data_url(PNG_BYTES))
    b = decode_data_url(f"data:image/png;base64,{wrapped}")
    assert a.sha256 == b.sha256


def test_different_bytes_get_different_identifiers():
    assert decode_data_url(data_url(b"a")).sha256 != decode_data_url(data_url(b"b")).sha256


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
        ImageData.from_bytes(b"x" * (MAX_IMAGE_BYTES + 1), "image/png")


def test_remote_urls_are_refused_by_default_and_never_fetched():
    calls = []
    with pytest.raises(ValueError, match="allow-remote-images"):
        load_image("https://example.com/cat.png", allow_remote=False, fetch=calls.append)
    assert calls == []


def test_remote_urls_go_through_the_given_fetcher_only_when_allowed():
    fetched = []

    def fetch(url: str) -> bytes:
        fetched.append(url)
        return PNG_BYTES

    image = load_image("https://example.com/cat.png", allow_remote=True, fetch=fetch)
    assert fetched == ["https://example.com/cat.png"]
    assert image.sha256 == hashlib.sha256(PNG_BYTES).hexdigest()


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://x/y.png", "cat.png", "", None, 3])
def test_other_schemes_and_non_strings_are_refused(url):
    with pytest.raises(ValueError):
        load_image(url, allow_remote=True, fetch=lambda u: b"x")


def test_http_fetcher_is_bounded_and_reports_failures_as_value_errors():
    import httpx

    from engine.server.images import http_fetcher

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ok.png":
            return httpx.Response(200, content=PNG_BYTES)
        if request.url.path == "/big.png":
            return httpx.Response(200, content=b"x" * 5000)
        if request.url.path == "/moved.png":
            return httpx.Response(302, headers={"location": "http://internal/secret"})
        return httpx.Response(404)

    fetch = http_fetcher(max_bytes=4096, transport=httpx.MockTransport(handler))
    assert fetch("http://img.test/ok.png") == PNG_BYTES
    with pytest.raises(ValueError, match="larger"):
        fetch("http://img.test/big.png")
    with pytest.raises(ValueError, match="302"):
        fetch("http://img.test/moved.png")
    with pytest.raises(ValueError, match="404"):
        fetch("http://img.test/missing.png")
