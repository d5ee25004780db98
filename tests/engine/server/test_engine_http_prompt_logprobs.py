"""prompt_logprobs on /v1/completions over real loopback HTTP (the official openai SDK,
vLLM's extra body field): vLLM's response shape, the same numbers as the engine's,
streaming, and bad values refused with a 400."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

PROMPT = "One two three four five six seven eight nine ten."


def test_completion_carries_vllms_prompt_logprobs(client, tiny_engine):
    ids = tiny_engine.tokenizer(PROMPT)["input_ids"]
    out = client.completions.create(model=tiny_engine.model_id, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    plain = client.completions.create(model=tiny_engine.model_id, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == plain.choices[0].text
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        mine = entry[str(token)]
        assert mine["decoded_token"] == tiny_engine.tokenizer.decode([token])
        assert mine["logprob"] <= 0 and mine["rank"] >= 1
        ranked = sorted(entry.values(), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked][:2] == [1, 2]  # the two alternatives, best first
        assert [v["logprob"] for v in ranked] == sorted((v["logprob"] for v in ranked), reverse=True)
        assert len(entry) == (2 if mine["rank"] <= 2 else 3)
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.prompt_tokens_details is None or out.usage.prompt_tokens_details.cached_tokens == 0
    total = sum(e[str(t)]["logprob"] for t, e in zip(ids[1:], entries[1:], strict=True))
    assert math.isfinite(total)


def test_streaming_puts_them_in_the_first_chunk(client, tiny_engine):
    chunks = list(client.completions.create(model=tiny_engine.model_id, prompt=PROMPT, max_tokens=3,
                                            temperature=0, stream=True, extra_body={"prompt_logprobs": 0}))
    carrying = [c for c in chunks if c.choices and (c.choices[0].model_extra or {}).get("prompt_logprobs")]
    assert len(carrying) == 1 and carrying[0] is chunks[0]
    entries = carrying[0].choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])


@pytest.mark.parametrize("bad", [-1, 21, "3", 1.5])
def test_bad_values_are_a_400(live, tiny_engine, bad):
    r = httpx.post(f"{live.api_url}/completions", timeout=60,
                   json={"model": tiny_engine.model_id, "prompt": PROMPT, "prompt_logprobs": bad})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0).completions.create(
            model=tiny_engine.model_id, prompt=PROMPT, extra_body={"prompt_logprobs": bad})
