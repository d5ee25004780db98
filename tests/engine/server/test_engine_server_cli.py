"""``prefixgate engine``: its parser, its lazy imports, and the real process end to end."""

import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from support.net import free_port
from test_engine_http_fixtures import wait_until

from gateway.cli import build_parser


def test_defaults_follow_the_process_contract():
    args = build_parser().parse_args(["engine"])
    assert (args.model, args.host, args.port) == (None, "127.0.0.1", 8001)
    assert (args.block_size, args.dtype, args.served_model_name) == (16, "auto", None)
    assert args.kv_cache_memory > 0
    assert args.allowed_media_domains == [] and not args.no_prefix_caching
    assert args.media_fetch_timeout == 10.0 and args.max_images_per_request == 8
    assert args.max_image_pixels_in_flight == 320_000_000
    assert callable(args.func)


def test_every_contract_flag_parses():
    args = build_parser().parse_args([
        "engine", "--model", "/models/x", "--host", "0.0.0.0", "--port", "9000", "--block-size", "32",
        "--kv-cache-memory", "0.5", "--dtype", "float32", "--served-model-name", "m",
        "--allowed-media-domains", "img.example", "cdn.example", "--media-fetch-timeout", "2.5",
        "--max-images-per-request", "3", "--max-image-pixels-in-flight", "1000000",
        "--no-prefix-caching",
    ])
    assert (args.model, args.host, args.port, args.block_size) == ("/models/x", "0.0.0.0", 9000, 32)
    assert (args.kv_cache_memory, args.dtype, args.served_model_name) == (0.5, "float32", "m")
    assert args.allowed_media_domains == ["img.example", "cdn.example"] and args.no_prefix_caching
    assert args.media_fetch_timeout == 2.5 and args.max_images_per_request == 3
    assert args.max_image_pixels_in_flight == 1_000_000


@pytest.mark.parametrize("argv", [["--port", "0"], ["--port", "70000"], ["--block-size", "-1"],
                                  ["--kv-cache-memory", "0"], ["--dtype", "float16"],
                                  ["--media-fetch-timeout", "0"], ["--allowed-media-domains"],
                                  ["--max-images-per-request", "0"], ["--max-image-pixels-in-flight", "0"]])
def test_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["engine", *argv])
    assert info.value.code == 2


def test_the_removed_allow_remote_images_flag_is_a_usage_error_naming_its_replacement(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["engine", "--allow-remote-images"])
    assert info.value.code == 2
    assert "--allowed-media-domains" in capsys.readouterr().err


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--help"])
    out = capsys.readouterr().out
    assert "example:" in out and "prefixgate engine --port 8001" in out


def test_building_the_parser_does_not_import_torch():
    code = (
        "import argparse, sys\n"
        "import engine.cli\n"
        "engine.cli.add_parser(argparse.ArgumentParser().add_subparsers())\n"
        "print(sorted(m for m in ('torch', 'transformers', 'engine.server.app', 'engine.core.llm_engine') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"



@pytest.mark.real_model
def test_the_engine_process_serves_the_bundled_model_and_stops_on_sigterm(tmp_path):
    port = free_port()
    log = tmp_path / "engine.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--port", str(port), "--kv-cache-memory", "0.1"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the engine exited with {proc.returncode}:\n{log.read_text()}")
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 300, "the engine process to answer /health", interval_s=0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        resp = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, temperature=0
        )
        assert resp.choices[0].message.content
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        # SIGTERM while a long stream is open: graceful stop, the stream is cut, exit 0.
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell a long story"}],
                "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as stream:
            assert next(line for line in stream.iter_lines() if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "KV blocks" in text
    assert f"127.0.0.1:{port}" in text



def test_a_missing_model_fails_clearly_with_exit_code_1(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "engine", "--model", str(missing)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1
    assert "could not load the model" in proc.stderr and str(missing) in proc.stderr


def test_batching_flags_parse_and_reject_zero():
    args = build_parser().parse_args(
        ["engine", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--threads", "1"]
    )
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.threads) == (8, 256, 1)
    defaults = build_parser().parse_args(["engine"])
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens, defaults.threads) == (64, 512, None)
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--threads"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["engine", flag, "0"])
        assert info.value.code == 2


@pytest.mark.parametrize("host", ["http://img.example", "img.example:8080", "*.example", "user@img.example"])
def test_allowed_media_domains_take_host_names_only(host, caplog):
    args = build_parser().parse_args(["engine", "--allowed-media-domains", host])
    assert args.func(args) == 2
    assert "allowed-media-domains" in caplog.text


def test_segment_reuse_is_off_unless_asked_for():
    assert build_parser().parse_args(["engine"]).segment_reuse is False
    assert build_parser().parse_args(["engine", "--segment-reuse"]).segment_reuse is True
