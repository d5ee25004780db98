"""Remote image URLs: ``--allowed-media-domains`` against a real HTTP server on loopback.

The server below answers fixed routes; one of them holds its response until the
test ends (an :class:`threading.Event`), so the fetch time limit is exercised
without a sleep in the test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
from image_samples import data_url, png

from engine.contract.chat import ChatRenderer, ImagePlaceholder
from engine.contract.errors import APIError
from engine.contract.images import ImageData, MediaPolicy, load_image

PICTURE = png(10, 7, seed=6)


class Routes(BaseHTTPRequestHandler):
    release = threading.Event()
    hits: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        Routes.hits.append(self.path)
        port = self.server.server_address[1]
        if self.path == "/ok.png":
            self._send(200, PICTURE)
        elif self.path == "/text":
            self._send(200, b"not an image at all")
        elif self.path == "/big.png":
            self._send(200, PICTURE + b"\0" * 4096)
        elif self.path == "/same-host":
            self._send(302, b"", location="/ok.png")
        elif self.path == "/other-host":
            self._send(302, b"", location=f"http://localhost:{port}/ok.png")
        elif self.path == "/loop":
            self._send(302, b"", location="/loop")
        elif self.path == "/hang":
            self.send_response(200)
            self.send_header("content-length", "100000")
            self.end_headers()
            self.wfile.write(PICTURE[:10])
            self.wfile.flush()
            Routes.release.wait(30)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        if location is not None:
            self.send_header("location", location)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Routes)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    Routes.release.set()
    httpd.shutdown()
    httpd.server_close()


def fetcher(**kwargs: object):
    policy = MediaPolicy(frozenset({"127.0.0.1"}), **kwargs)  # type: ignore[arg-type]
    fetch = policy.fetcher()
    assert fetch is not None
    return fetch


def test_an_allowed_host_is_fetched_and_decoded(server):
    image = load_image(server + "/ok.png", allow_remote=True, fetch=fetcher())
    assert image.sha256 == ImageData.from_bytes(PICTURE).sha256
    assert image.image.size == (10, 7)


def test_the_same_pixels_remote_and_inline_have_one_identifier(server):
    remote = load_image(server + "/ok.png", allow_remote=True, fetch=fetcher())
    assert remote.sha256 == load_image(data_url(PICTURE), allow_remote=False).sha256


def test_no_policy_means_no_fetcher_and_no_request(server):
    assert MediaPolicy().fetcher() is None
    before = len(Routes.hits)
    with pytest.raises(ValueError, match="allowed-media-domains"):
        load_image(server + "/ok.png", allow_remote=False, fetch=MediaPolicy().fetcher())
    assert len(Routes.hits) == before


def test_a_host_not_on_the_list_is_never_contacted(server):
    fetch = MediaPolicy(frozenset({"img.example"})).fetcher()
    before = len(Routes.hits)
    with pytest.raises(ValueError, match=r"'127\.0\.0\.1' is not in --allowed-media-domains"):
        fetch(server + "/ok.png")  # type: ignore[misc]
    with pytest.raises(ValueError, match="not in --allowed-media-domains"):
        fetch(server.replace("http://", "http://img.example@") + "/ok.png")  # type: ignore[misc]
    assert len(Routes.hits) == before


def test_a_redirect_is_followed_on_an_allowed_host_only(server):
    assert fetcher()(server + "/same-host") == PICTURE
    with pytest.raises(ValueError, match="'localhost' is not in --allowed-media-domains"):
        fetcher()(server + "/other-host")
    with pytest.raises(ValueError, match="redirects"):
        fetcher()(server + "/loop")


def test_size_and_time_limits(server):
    with pytest.raises(ValueError, match="larger than"):
        fetcher(max_bytes=len(PICTURE) + 100)(server + "/big.png")
    with pytest.raises(ValueError, match=r"could not fetch|timeout"):
        fetcher(timeout_s=0.5)(server + "/hang")


def test_http_errors_and_unreachable_hosts_are_value_errors(server):
    with pytest.raises(ValueError, match="404"):
        fetcher()(server + "/missing.png")
    closed = server.rsplit(":", 1)[0] + ":1"
    with pytest.raises(ValueError, match="could not fetch"):
        fetcher()(closed + "/ok.png")


SPEC = ImagePlaceholder(text="<image>", token_id=5, tokens_per_image=3)


class WordTokenizer:
    """Just enough tokenizer for ChatRenderer: one id per word, a template that joins contents."""

    chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

    def __init__(self) -> None:
        self.vocab = {"<image>": 5}

    def apply_chat_template(self, conversation, **kwargs):
        return " ".join(m["content"] for m in conversation)

    def encode(self, text, add_special_tokens=True):
        return [self.vocab.setdefault(w, len(self.vocab) + 100) for w in text.split()]

    def __len__(self) -> int:
        return 1000


@pytest.mark.parametrize("path", ["/text", "/missing.png", "/other-host"])
def test_a_bad_remote_image_is_a_400_naming_the_part(server, path):
    media = MediaPolicy(frozenset({"127.0.0.1"}))
    renderer = ChatRenderer(WordTokenizer(), supports_images=True, image_placeholder=SPEC,
                            allow_remote_images=media.allows_remote, fetch=media.fetcher())
    content = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": server + path}}]
    with pytest.raises(APIError) as info:
        renderer.render([{"role": "user", "content": content}])
    assert info.value.status_code == 400
    assert info.value.param == "messages[0].content[1].image_url"
    good = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": server + "/ok.png"}}]
    assert renderer.render([{"role": "user", "content": good}]).mm_items[0].length == 3
