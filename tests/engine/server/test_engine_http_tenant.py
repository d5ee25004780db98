"""The ``x-prefixgate-tenant`` header names the scheduler's fairness key, over HTTP.

The tenant reaches the engine's request (seen through a spy on the scheduler), the
answer is the one the same request gets without the header, and a header the engine
cannot keep is a 400 in OpenAI's shape.
"""

import openai
import pytest

from engine.core.scheduler import Scheduler
from engine.server.request_handler import MAX_TENANT_CHARS, TENANT_HEADER

MSG = [{"role": "user", "content": "Tell me a number"}]


def test_the_tenant_header_reaches_the_scheduler_and_changes_no_answer(live, monkeypatch):
    seen = []
    real_add = Scheduler.add

    def spy(self, req):
        seen.append((req.tenant, req.kv.cache_salt))
        real_add(self, req)

    monkeypatch.setattr(Scheduler, "add", spy)
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=60)
    plain = client.chat.completions.create(model=None, messages=MSG, max_tokens=8, temperature=0)
    named = client.chat.completions.create(model=None, messages=MSG, max_tokens=8, temperature=0,
                                           extra_headers={TENANT_HEADER: "team-a"})
    salted = client.chat.completions.create(model=None, messages=MSG, max_tokens=8, temperature=0,
                                            extra_body={"cache_salt": "s1"})
    assert named.choices[0].message.content == plain.choices[0].message.content
    assert salted.choices[0].message.content == plain.choices[0].message.content
    assert seen == [(None, None), ("team-a", None), ("s1", "s1")]  # the salt is the key without the header


@pytest.mark.parametrize("value", ["", "x" * (MAX_TENANT_CHARS + 1)])
def test_a_tenant_header_out_of_bounds_is_a_400(live, value):
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=None, messages=MSG, max_tokens=2, extra_headers={TENANT_HEADER: value})
    error = info.value.response.json()["error"]
    assert error["code"] == "invalid_tenant" and TENANT_HEADER in error["message"]
