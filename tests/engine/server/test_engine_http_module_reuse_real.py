"""Module KV reuse seen by a client (issue 21): PML prompts with their modules in another
order report the reused module tokens as cached_tokens, through the openai SDK."""

from __future__ import annotations

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve

pytestmark = pytest.mark.real_model

DOCS = {
    "north": "North pier: boats to the lighthouse leave at nine, noon and three, weather permitting. " * 3,
    "south": "South pier: the fish market opens at dawn and closes at one in the afternoon on weekdays. " * 3,
    "west": "West quay: the sailing school rents dinghies by the hour from April until October. " * 3,
}
SCHEMA = ('<schema name="quays"><system>Answer from the notices.</system>'
          + "".join(f'<module name="{k}"><user>{v}</user></module>' for k, v in DOCS.items()) + "</schema>")


@pytest.fixture(scope="module")
def live(real_engine):
    with serve(real_engine) as server:
        yield server


def test_modules_in_another_order_are_cached_tokens(live, real_engine):
    with httpx.Client(base_url=live.base_url, timeout=120) as http:
        assert http.post("/v1/prompt_schemas", json={"pml": SCHEMA}).status_code == 200
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=300)

    def ask(order, question):
        prompt = ('<prompt schema="quays">' + "".join(f"<{k}/>" for k in order)
                  + f"<user>{question}</user><assistant/></prompt>")
        return client.completions.create(model=real_engine.model_id, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"prompt_format": "pml"})

    before = real_engine.stats()
    first = ask(("north", "south", "west"), "When do boats leave?")
    second = ask(("west", "north"), "Where can I rent a dinghy?")
    after = real_engine.stats()
    assert after.module_tokens_encoded > before.module_tokens_encoded
    hit = second.usage.prompt_tokens_details.cached_tokens
    # both modules of the second prompt were encoded by the first: reused, minus recovery
    assert hit >= 0.5 * (second.usage.prompt_tokens - 40), (hit, second.usage)
    assert after.module_tokens_reused - before.module_tokens_reused >= hit - 16
    assert first.choices[0].text and second.choices[0].text
    with httpx.Client(base_url=live.base_url, timeout=60) as http:
        metrics = http.get("/metrics").text
    assert "prefixgate_engine_module_reused_tokens_total" in metrics
