"""``prefixgate engine``: load a model and serve it behind the OpenAI-compatible server.

Building the parser imports nothing heavy: torch, transformers and the server are
imported inside :func:`run`, so ``prefixgate lint --help`` stays fast and torch-free.
The model is loaded (and the bundled GGUF converted once) before the port opens, so
``GET /health`` answering 200 means the engine is ready. uvicorn turns SIGINT and
SIGTERM into a graceful stop; the engine thread is shut down afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from engine.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_ENCODER_CACHE_MEMORY_GIB,
    DEFAULT_KV_CACHE_MEMORY_GIB,
    DEFAULT_KV_MIRROR_MEMORY_GIB,
    DEFAULT_KV_OFFLOAD_SIZE_GIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SPECULATIVE_TOKENS,
    DTYPES,
    KV_COMPRESSIONS,
    MAX_SPECULATIVE_TOKENS,
    WEIGHTS,
)
from engine.contract.images import (
    FETCH_TIMEOUT_S,
    MAX_IMAGE_BYTES,
    MAX_IMAGES_PER_REQUEST,
    MediaPolicy,
)
from engine.contract.pixel_budget import (
    DEFAULT_MAX_PIXELS_IN_FLIGHT,
    DEFAULT_MAX_WAITING,
    DEFAULT_WAIT_S,
)

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8001

EPILOG = """\
example:
  prefixgate engine --port 8001
  curl http://127.0.0.1:8001/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "SmolLM2-135M-Instruct", "max_tokens": 32,
         "messages": [{"role": "user", "content": "Say hi"}]}'

Without --model the bundled SmolLM2-135M-Instruct is served (converted once from its
GGUF file into $PREFIXGATE_HOME, default ~/.cache/prefixgate). No model hub is used.
Keep KV blocks on disk too, so a restarted engine starts warm and a working set
larger than --kv-cache-memory is loaded instead of recomputed:
  prefixgate engine --kv-offload-dir ~/.cache/prefixgate/kv --kv-offload-size 20
Keep fewer tokens' KV in deeper layers after each prefill (PyramidInfer-style, opt-in;
a request may still send "kv_compression": "none"):
  prefixgate engine --kv-compression pyramid --kv-min-retention 0.2
A vision-language checkpoint (LLaVA, Idefics3/SmolVLM) accepts image_url parts:
  prefixgate engine --model ./my-llava --encoder-cache-memory 0.5
With PREFIXGATE_ENGINE_API_KEY set (or --api-key), clients must send
'Authorization: Bearer <key>' (the OpenAI SDK's api_key) on every route but /health.
"""


def add_parser(subparsers: Any) -> None:
    """Register ``prefixgate engine``."""
    parser = subparsers.add_parser(
        "engine",
        help="serve a local model with prefix caching (OpenAI-compatible HTTP)",
        description="Serve a local model behind an OpenAI-compatible HTTP API, reusing the KV "
        "cache of exact prompt prefixes.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a local Hugging Face checkpoint directory or a GGUF file "
                        "(default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--encoder-cache-memory", type=_positive_float, default=DEFAULT_ENCODER_CACHE_MEMORY_GIB,
                        metavar="GIB",
                        help="memory for image features of a vision-language model in GiB "
                        f"(default: {DEFAULT_ENCODER_CACHE_MEMORY_GIB})")
    parser.add_argument("--host", default=DEFAULT_HOST,
                        help=f"address to bind (default: {DEFAULT_HOST}, loopback only)")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
                        help=f"port to listen on (default: {DEFAULT_PORT})")
    parser.add_argument("--block-size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                        help=f"tokens per KV cache block (default: {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--kv-cache-memory", type=_positive_float, default=DEFAULT_KV_CACHE_MEMORY_GIB,
                        metavar="GIB",
                        help=f"memory for the KV cache in GiB (default: {DEFAULT_KV_CACHE_MEMORY_GIB})")
    parser.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                        help="also keep full KV blocks as files in DIR (created 0700; one engine per DIR), "
                        "loaded on a RAM miss and after a restart (default: off)")
    parser.add_argument("--kv-offload-size", type=_positive_float, default=DEFAULT_KV_OFFLOAD_SIZE_GIB,
                        metavar="GIB",
                        help="bound on the files in --kv-offload-dir, least recently used removed first "
                        f"(default: {DEFAULT_KV_OFFLOAD_SIZE_GIB:g})")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights and KV dtype; auto = bfloat16 where the CPU supports it "
                        "natively, else float32 (default: auto)")
    parser.add_argument("--weights", choices=WEIGHTS, default="dense",
                        help="projections: dense (the checkpoint in --dtype) or q4_1 (opt-in: the GGUF's "
                        "4-bit blocks as shipped, faster decoding, other numbers; a Llama GGUF in "
                        "bfloat16) (default: dense)")
    parser.add_argument("--no-gguf-decode", action="store_true",
                        help="with dense weights, keep the bfloat16 weights for decode steps too; by default "
                        "a GGUF's Q4_1 blocks (the bundled model's) serve products of up to 8 rows with the "
                        "same bits, a third of the bytes read (same outputs either way)")
    parser.add_argument("--kv-compression", choices=KV_COMPRESSIONS, default="none",
                        help="requests' default KV after prefill: none (exact) or pyramid (each layer "
                        "keeps the tokens the prompt's last tokens attend to, fewer in deeper layers; "
                        "a request's \"kv_compression\" overrides it) (default: none)")
    parser.add_argument("--kv-min-retention", type=_positive_float, default=0.2, metavar="SHARE",
                        help="pyramid: share of the tokens the deepest layer keeps, in (0, 1]; layer 0 "
                        "keeps all (default: 0.2)")
    parser.add_argument("--kv-window", type=_positive_int, default=32, metavar="TOKENS",
                        help="pyramid: most recent tokens every layer keeps, whose attention picks the "
                        "rest; also how often decoding selects again (default: 32)")
    parser.add_argument("--kv-mirror-memory", type=_non_negative_float, default=DEFAULT_KV_MIRROR_MEMORY_GIB,
                        metavar="GIB",
                        help="memory for contiguous copies of long requests' K/V (1k+ tokens) and of "
                        "compressed requests' kept K/V, which attention reads instead of gathering them from "
                        "the paged cache every step; 0 turns them off; outputs are the same either way "
                        f"(default: {DEFAULT_KV_MIRROR_MEMORY_GIB})")
    parser.add_argument("--speculative-tokens", type=_speculative_tokens, default=DEFAULT_SPECULATIVE_TOKENS,
                        metavar="N",
                        help="speculative decoding: a decoding request's next forward also checks up to N "
                        "draft tokens looked up in its own prompt and output (prompt lookup); only drafts "
                        "equal to the tokens it samples are kept, so outputs are the same bit for bit; "
                        f"0 turns it off (default: {DEFAULT_SPECULATIVE_TOKENS}, at most {MAX_SPECULATIVE_TOKENS})")
    parser.add_argument("--kv-progressive", action="store_true",
                        help="pyramid: compress a long prompt as soon as its first chunk reaches 128 tokens "
                        "and compute the rest over the kept KV, chunk by chunk, selecting again after each "
                        "(fewer exact blocks held while prefilling; approximate prefill)")
    parser.add_argument("--kv-layerwise", action="store_true",
                        help="pyramid: --kv-progressive, and a chunk's token that a layer drops is not "
                        "computed in deeper layers (PyramidInfer's prefill: cheaper long prompts)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None, metavar="TOKENS",
                        help="context length limit (default: the model's)")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                        help=f"requests batched in one forward at most (default: {DEFAULT_MAX_NUM_SEQS})")
    parser.add_argument("--max-num-batched-tokens", type=_positive_int,
                        default=DEFAULT_MAX_NUM_BATCHED_TOKENS, metavar="TOKENS",
                        help="tokens per forward at most: decode tokens plus prefill chunks "
                        f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    parser.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                        help="torch threads for the model's forward (default: torch's, one per "
                        "core; fewer leave cores to the HTTP server and to other processes)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="model name clients send (default: the model's name)")
    parser.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                        help="fetch http(s) image URLs from these hosts only, exact names, like vLLM's "
                        "flag (default: none; images must be inline data: URLs)")
    parser.add_argument("--media-fetch-timeout", type=_positive_float, default=FETCH_TIMEOUT_S,
                        metavar="SECONDS",
                        help=f"time limit of one remote image fetch, redirects included "
                        f"(default: {FETCH_TIMEOUT_S:g}); at most {MAX_IMAGE_BYTES // 2**20} MiB are read")
    parser.add_argument("--max-images-per-request", type=_positive_int, default=MAX_IMAGES_PER_REQUEST,
                        metavar="N",
                        help="image parts one request may carry; more is a 400 before any is decoded "
                        f"(default: {MAX_IMAGES_PER_REQUEST})")
    parser.add_argument("--max-image-pixels-in-flight", type=_positive_int, default=DEFAULT_MAX_PIXELS_IN_FLIGHT,
                        metavar="PIXELS",
                        help="decoded image pixels all requests together may hold (each request reserves "
                        "its images' width x height before decoding them); beyond it a request waits up to "
                        f"{DEFAULT_WAIT_S:g} s behind at most {DEFAULT_MAX_WAITING} others, then gets a 429, "
                        "and one needing more than the whole budget a 400 "
                        f"(default: {DEFAULT_MAX_PIXELS_IN_FLIGHT:,}, eight images of 40 M pixels)")
    parser.add_argument("--allow-remote-images", nargs=0, action=_Replaced, help=argparse.SUPPRESS,
                        replacement="--allowed-media-domains HOST [HOST ...]")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="disable reuse of cached prompt prefixes")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help="publish KV-cache events like vLLM, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", "
                        "\"replay_endpoint\": \"tcp://127.0.0.1:5558\"}' (see docs/routing.md)")
    parser.add_argument("--segment-reuse", action="store_true",
                        help="treat each chat message and text part of at least one block as a "
                        "position-independent segment unless a request says \"segment_reuse\": false "
                        "(default: off; see docs/prompt_modules.md)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health, like "
                        "vLLM's --api-key (default: $PREFIXGATE_ENGINE_API_KEY; prefer it: a command "
                        "line is visible to every local user)")
    parser.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="log level (default: info)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the model on the engine thread, start its loop there and serve until stopped."""
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from engine.config import EngineConfig

    try:
        config = EngineConfig(
            model=args.model, dtype=args.dtype, block_size=args.block_size,
            kv_cache_memory_gib=args.kv_cache_memory, enable_prefix_caching=not args.no_prefix_caching,
            max_model_len=args.max_model_len, served_model_name=args.served_model_name,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            encoder_cache_memory_gib=args.encoder_cache_memory, num_threads=args.threads,
            kv_offload_dir=args.kv_offload_dir, kv_offload_size_gib=args.kv_offload_size,
            weights=args.weights, kv_compression=args.kv_compression,
            kv_min_retention=args.kv_min_retention, kv_window=args.kv_window,
            kv_progressive=args.kv_progressive, kv_layerwise=args.kv_layerwise, kv_mirror_memory_gib=args.kv_mirror_memory,
            speculative_tokens=args.speculative_tokens, gguf_decode=not args.no_gguf_decode,
        )
        _check_model(args.model)
        events_config = None
        if args.kv_events_config is not None:
            from engine.server.kv_event_publisher import KVEventsConfig

            events_config = KVEventsConfig.from_json(args.kv_events_config)
        media = MediaPolicy(frozenset(args.allowed_media_domains), timeout_s=args.media_fetch_timeout,
                            max_images_per_request=args.max_images_per_request,
                            max_pixels_in_flight=args.max_image_pixels_in_flight)
    except ValueError as exc:
        logger.error("invalid engine settings: %s", exc)
        return 2

    from engine.contract.api_key import API_KEY_ENV
    from engine.core.llm_engine import LLMEngine
    from engine.server.app import run_server

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None:
        logger.warning("no --api-key: anyone who can reach %s:%d can use this engine", args.host, args.port)

    try:
        engine = LLMEngine.launch(config)  # loads and runs on one thread (see launch)
    except (OSError, ValueError) as exc:
        logger.error("could not load the model: %s", exc)
        return 1
    kv = engine.kv_cache_manager
    logger.info("serving %r: %d KV blocks of %d tokens (%d tokens of cache), max_model_len %d",
                engine.model_id, kv.num_blocks, engine.block_size, kv.num_blocks * engine.block_size,
                engine.max_model_len)
    publisher = None
    if events_config is not None and events_config.enabled:
        from engine.server.kv_event_publisher import KvEventPublisher

        publisher = KvEventPublisher(events_config)
        kv.block_pool.event_sink = publisher.recorder
        publisher.start()
        if engine.offload is not None:
            engine.offload.announce_existing()  # the router learns what this replica holds on disk
    try:
        run_server(engine, host=args.host, port=args.port, api_key=api_key,
                   media=media, log_level=args.log_level, segment_reuse=args.segment_reuse)
    finally:
        engine.shutdown()
        if publisher is not None:
            publisher.shutdown()
    return 0


class _Replaced(argparse.Action):
    """A removed flag: using it is a usage error (exit 2) naming its replacement."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} was removed: allow hosts by name with {self.replacement}")


def _check_model(model: str | None) -> None:
    """ValueError (exit 2) for a checkpoint directory of an unsupported multimodal architecture,
    before anything heavy loads."""
    if model is None:
        return
    from pathlib import Path

    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        from engine.multimodal.vlm import vlm_architecture

        vlm_architecture(path)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _speculative_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"expected 0 to {MAX_SPECULATIVE_TOKENS}, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {text!r}")
    return value
