"""``prefixgate engine --model DIR`` with a tiny random LLaVA checkpoint, through the openai SDK.

The issue's "done when": data-URL images answered over loopback HTTP; the second
identical request reports cached tokens covering the image; another image gets no
cached block from the first one its placeholders touch; the text equals what
transformers' ``generate`` produces from the same checkpoint; the encoder cache is
counted in ``/metrics``. Also: an unsupported multimodal architecture is a one-line
usage error (exit 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from support.net import free_port
from vlm_samples import data_url, picture

BS = 4
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}



def wait_healthy(proc, port, log, timeout_s=300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the engine exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)  # polling a child process's port: no event to wait on
    raise AssertionError(f"no /health within {timeout_s} s:\n{log.read_text()}")


def messages(image):
    return [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": data_url(image)}}]}]


def expected_text(model_dir, image):
    """transformers alone: the checkpoint's processor and ``generate``, greedy."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(str(model_dir), local_files_only=True)
    model = LlavaForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                          local_files_only=True).eval()
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], add_special_tokens=False, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    image_start = inputs["input_ids"][0].tolist().index(processor.image_token_id)
    return processor.tokenizer.decode(new, skip_special_tokens=True), image_start


def test_a_served_tiny_llava_caches_image_blocks_and_matches_transformers(vlm_dirs, tmp_path):
    model_dir = vlm_dirs["llava"]
    port, log = free_port(), tmp_path / "engine.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "engine", "--model", str(model_dir), "--port", str(port),
             "--dtype", "float32", "--block-size", str(BS), "--kv-cache-memory", "0.01",
             "--encoder-cache-memory", "0.01"],
            stdout=out, stderr=subprocess.STDOUT, env=ENV,
        )
    try:
        wait_healthy(proc, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)

        def ask(image):
            return client.chat.completions.create(model=model_dir.name, messages=messages(image),
                                                  max_tokens=8, temperature=0)

        first, second, other = ask(picture(1)), ask(picture(1)), ask(picture(2))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        # the same picture through /v1/responses (input_image): same prompt, so its image blocks are cached
        response = client.responses.create(model=model_dir.name, max_output_tokens=8, temperature=0, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is in this picture?"},
                                         {"type": "input_image", "image_url": data_url(picture(1))}]}])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    text, image_start = expected_text(model_dir, picture(1))
    prompt_tokens = first.usage.prompt_tokens
    assert first.choices[0].message.content == second.choices[0].message.content == text
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    image_end = image_start + 16  # the checkpoint's image_seq_length
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (prompt_tokens - 1) // BS * BS >= image_end
    assert other.usage.prompt_tokens_details.cached_tokens == image_start // BS * BS
    assert response.output_text == text
    assert response.usage.input_tokens == prompt_tokens and response.usage.input_tokens_details.cached_tokens == cached
    assert f'prefixgate_engine_encoder_cache_misses_total{{model_name="{model_dir.name}"}} 2.0' in metrics
    assert f'prefixgate_engine_encoder_cache_entries{{model_name="{model_dir.name}"}} 2.0' in metrics


def test_an_unsupported_multimodal_architecture_is_a_usage_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"],
                                                      "vision_config": {}}))
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "engine", "--model", str(tmp_path)],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2
    assert "Qwen2VLForConditionalGeneration" in proc.stderr and "LlavaForConditionalGeneration" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_only_llama_language_models_and_the_two_architectures_are_accepted(vlm_dirs, tmp_path):
    from engine.multimodal.vlm import vlm_architecture

    assert vlm_architecture(vlm_dirs["llava"]) == "LlavaForConditionalGeneration"
    assert vlm_architecture(vlm_dirs["idefics3"]) == "Idefics3ForConditionalGeneration"
    config = json.loads((vlm_dirs["llava"] / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'mistral' language model is not supported"):
        vlm_architecture(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert vlm_architecture(tmp_path) is None


def test_the_chat_renderer_still_imports_no_torch():
    # the gateway renders chats with engine.contract.chat; the VLM path must not pull torch into it
    code = "import sys, engine.contract.chat; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
