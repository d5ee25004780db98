"""PML and segment_reuse with the real bundled SmolLM2-135M-Instruct, through the openai SDK.

Its own chat template (ChatML) renders the role tags; the prompt the engine counts is
exactly the compiled one, and segment reuse never changes the prompt of a chat request.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_engine_http_fixtures import serve

from engine.promptcache.pml_compiler import PmlCompiler, PmlLimits

pytestmark = pytest.mark.real_model

DOCS = {
    "tides": "Tide tables: high water at the harbour is at six in the morning and half past six in the evening. ",
    "ferry": "Ferry notice: the island ferry leaves the north pier every two hours from eight until eight. ",
    "cafe": "Cafe hours: the pier cafe opens at seven and serves breakfast until eleven every day of the week. ",
}
SCHEMA = ('<schema name="harbour"><system>Answer in one short sentence from the notices.</system>'
          + "".join(f'<module name="{k}"><user>{v * 2}</user></module>' for k, v in DOCS.items())
          + "</schema>")


@pytest.fixture(scope="module")
def live(real_engine):
    with serve(real_engine) as server:
        yield server


def test_pml_completion_with_the_openai_sdk(live, real_engine):
    with httpx.Client(base_url=live.base_url, timeout=120) as http:
        created = http.post("/v1/prompt_schemas", json={"pml": SCHEMA})
        assert created.status_code == 200, created.text
        assert [m["name"] for m in created.json()["modules"]] == list(DOCS)
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=300)
    compiler = PmlCompiler(real_engine.tokenizer, PmlLimits(max_param_tokens=real_engine.max_model_len))
    schema = compiler.schema(SCHEMA)
    for order in (("ferry", "tides"), ("tides", "cafe", "ferry")):
        prompt = ('<prompt schema="harbour">' + "".join(f"<{k}/>" for k in order)
                  + "<user>When does the ferry leave?</user><assistant/></prompt>")
        out = client.completions.create(model=real_engine.model_id, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"prompt_format": "pml"})
        compiled = compiler.prompt(prompt, {"harbour": schema}.get)
        assert out.usage.prompt_tokens == len(compiled.token_ids)
        assert out.choices[0].text.strip()
        expected = real_engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": "Answer in one short sentence from the notices."},
             *({"role": "user", "content": DOCS[k] * 2} for k in order),
             {"role": "user", "content": "When does the ferry leave?"}], tokenize=False, add_generation_prompt=True)
        assert real_engine.tokenizer.decode(compiled.token_ids) == expected


def test_segment_reuse_keeps_the_chat_prompt(live, real_engine):
    client = openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=300)
    messages = [{"role": "system", "content": "Answer in one short sentence."},
                {"role": "user", "content": [{"type": "text", "text": DOCS["cafe"] * 2},
                                             {"type": "text", "text": DOCS["tides"] * 2}]},
                {"role": "user", "content": "When does the cafe open?"}]
    plain = client.chat.completions.create(model=real_engine.model_id, messages=messages, max_tokens=8,
                                           temperature=0)
    reused = client.chat.completions.create(model=real_engine.model_id, messages=messages, max_tokens=8,
                                            temperature=0, extra_body={"segment_reuse": True})
    assert reused.usage.prompt_tokens == plain.usage.prompt_tokens
    assert reused.choices[0].message.content.strip()
