"""The engine's pixel budget over HTTP with a tiny LLaVA: a request whose images exceed it
alone is a 400, one that finds it full past its wait a 429 in OpenAI's shape, text
requests are served meanwhile, and requests within it get the answers they get alone."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from vlm_samples import data_url, picture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from test_engine_http_fixtures import serve

from engine.contract.images import MediaPolicy

SIDE = 32


def images_message(*seeds):
    parts = [{"type": "text", "text": "What is in these pictures?"}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(picture(s))}} for s in seeds]
    return [{"role": "user", "content": parts}]


@pytest.fixture
def live(make_vlm_engine):
    engine = make_vlm_engine("llava")
    with serve(engine, media=MediaPolicy(max_pixels_in_flight=2 * SIDE * SIDE)) as server:
        budget = server.server.config.app.state.handler.renderer.pixel_budget
        budget.wait_s = 0.2
        yield server, budget


def client_for(server):
    return openai.OpenAI(base_url=server.api_url, api_key="x", max_retries=0, timeout=120)


def test_images_within_the_budget_are_answered_and_the_budget_is_returned(live):
    server, budget = live
    client = client_for(server)
    first = client.chat.completions.create(model="tiny-llava", messages=images_message(1, 2), max_tokens=4,
                                           temperature=0)
    again = client.chat.completions.create(model="tiny-llava", messages=images_message(1, 2), max_tokens=4,
                                           temperature=0)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert budget.in_use == 0 and budget.peak == 2 * SIDE * SIDE


def test_images_exceeding_the_whole_budget_are_a_400(live):
    server, budget = live
    with pytest.raises(openai.BadRequestError) as info:
        client_for(server).chat.completions.create(model="tiny-llava", messages=images_message(1, 2, 3),
                                                   max_tokens=2)
    error = info.value.response.json()["error"]
    assert error["code"] == "too_many_image_pixels" and "3072 pixels" in error["message"]
    assert budget.in_use == 0


def test_a_full_budget_is_a_429_for_images_while_text_is_served(live):
    server, budget = live
    client = client_for(server)
    budget.acquire(SIDE * SIDE + 1)  # another request's images, still being processed
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny-llava", messages=images_message(4), max_tokens=2)
        body = info.value.response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == "rate_limit_exceeded"
        text = client.chat.completions.create(model="tiny-llava", max_tokens=2,
                                              messages=[{"role": "user", "content": "hi"}])
        assert text.choices[0].finish_reason == "length"
    finally:
        budget.release(SIDE * SIDE + 1)
    answer = client.chat.completions.create(model="tiny-llava", messages=images_message(4), max_tokens=2)
    assert answer.choices[0].finish_reason == "length" and budget.in_use == 0
