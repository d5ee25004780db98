"""End to end with the real bundled SmolLM2-135M-Instruct: the openai SDK over loopback HTTP.

One server for the module around the session's ``real_engine`` (default dtype).
Cached-token counts are checked exactly against the block rule, computed from the
prompts' own token ids: a hit covers the full blocks of the longest common token
prefix with an earlier request, and never the last prompt token.
"""

import openai
import pytest
from test_engine_http_fixtures import serve, wait_until

from engine.contract.chat import ChatRenderer

pytestmark = pytest.mark.real_model

SYSTEM = (
    "You are the support assistant of the Riverbend public library. Opening hours: Monday to "
    "Friday from nine in the morning until eight in the evening, Saturday from ten until four, "
    "closed on Sunday and on public holidays. Members may borrow up to twelve items at once for "
    "three weeks; items can be renewed twice online unless another member reserved them. Late "
    "returns cost twenty cents per item per day, capped at five dollars per item. The library "
    "offers free wifi, printing at ten cents per page, study rooms bookable for two hours, a "
    "children's corner with weekly story time on Wednesday afternoons, and a maker space with "
    "two 3D printers that require a short safety course. Lost cards are replaced for two dollars. "
    "Parking is free for two hours in the lot behind the building; bicycles can be locked at the "
    "racks by the main entrance. The reading room on the second floor is a quiet zone where phone "
    "calls are not allowed, and food is only permitted in the cafe next to the lobby. Volunteers "
    "run free computer classes for seniors every Tuesday morning and homework help for students "
    "on weekday afternoons during the school year. "
    "Answer in one short sentence, politely, and only with facts from this description."
)


@pytest.fixture(scope="module")
def live(real_engine):
    with serve(real_engine) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.api_url, api_key="x", max_retries=0, timeout=300)


def messages(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def ask(client, engine, question, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(
        model=engine.model_id, messages=messages(question), temperature=0, **kwargs
    )


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_models_lists_the_bundled_model(client, real_engine):
    assert real_engine.model_id == "SmolLM2-135M-Instruct"
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_shared_prefix_is_reused_by_the_block_rule_and_greedy_output_is_unchanged(client, real_engine):
    renderer = ChatRenderer(real_engine.tokenizer)
    bs = real_engine.block_size
    q1, q2 = "When does the library open on Saturday?", "How much do late returns cost?"
    ids1 = renderer.render(messages(q1)).token_ids
    ids2 = renderer.render(messages(q2)).token_ids
    shared = common_prefix(ids1, ids2)
    assert shared >= 200

    cold = ask(client, real_engine, q1, extra_body={"cache_salt": "real-run"})
    assert cold.usage.prompt_tokens == len(ids1)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content.strip()

    other = ask(client, real_engine, q2, extra_body={"cache_salt": "real-run"})
    assert other.usage.prompt_tokens_details.cached_tokens == (min(shared, len(ids2) - 1) // bs) * bs

    warm = ask(client, real_engine, q1, extra_body={"cache_salt": "real-run"})
    assert warm.usage.prompt_tokens_details.cached_tokens == ((len(ids1) - 1) // bs) * bs
    assert warm.choices[0].message.content == cold.choices[0].message.content

    stranger = ask(client, real_engine, q1, extra_body={"cache_salt": "another-tenant"})
    assert stranger.usage.prompt_tokens_details.cached_tokens == 0
    assert stranger.choices[0].message.content == cold.choices[0].message.content


def test_streaming_with_usage_gives_the_same_answer(client, real_engine):
    question = "Can I print documents there?"
    whole = ask(client, real_engine, question)
    chunks = list(ask(client, real_engine, question, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0
    kv = real_engine.kv_cache_manager
    wait_until(lambda: kv.num_free_blocks == kv.num_blocks, 60, "all blocks free after the stream")


def test_completions_endpoint_on_the_real_model(client, real_engine):
    resp = client.completions.create(model=real_engine.model_id, prompt="The capital of France is",
                                     max_tokens=5, temperature=0)
    assert resp.choices[0].text.strip()
    assert resp.usage.completion_tokens <= 5
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


REPAIR_TOOL = {"type": "function", "function": {
    "name": "book_repair", "description": "Book a repair visit for a broken item.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"}, "day": {"type": "string"}},
                   "required": ["item", "day"]}}}


def test_a_tool_call_cut_by_max_tokens_never_leaks_markup_on_the_real_model(client, real_engine):
    """tool_choice required: the output is a call in the template's tags; every max_tokens
    that cuts it leaves content free of them (streamed or not) and no partial call."""
    question = [{"role": "user", "content": "My washing machine is broken, book a repair for Monday."}]
    base = {"model": real_engine.model_id, "messages": question, "temperature": 0, "tools": [REPAIR_TOOL],
            "tool_choice": "required", "parallel_tool_calls": False}
    full = client.chat.completions.create(**base, max_tokens=80)
    assert full.choices[0].finish_reason == "tool_calls"
    for limit in range(1, full.usage.completion_tokens - 1, 3):  # each cuts the call short
        whole = client.chat.completions.create(**base, max_tokens=limit).choices[0]
        chunks = list(client.chat.completions.create(**base, max_tokens=limit, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        streamed_calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
        assert not whole.message.content and not streamed, (limit, whole.message.content, streamed)
        assert whole.finish_reason == "length" and not whole.message.tool_calls and not streamed_calls


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_generated_tool_call_sent_back_keeps_the_whole_turn_cached(client, real_engine, choice):
    """The assistant message holding a call the model wrote renders as the tokens it
    generated, so the next request (the call and its result appended) reuses every
    full block of the previous prompt and output: the call is written back in the
    convention's order (name, then arguments as the model wrote them), not re-sorted."""
    bs = real_engine.block_size
    question = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "My washing machine is broken, book a repair for Monday."}]
    base = {"model": real_engine.model_id, "temperature": 0, "tools": [REPAIR_TOOL], "tool_choice": choice,
            "max_tokens": 80, "extra_body": {"cache_salt": f"tool-turns-{choice}"}}
    first = client.chat.completions.create(messages=question, **base)
    message = first.choices[0].message
    if choice == "auto" and not message.tool_calls:
        pytest.skip("the model answered without a call")
    assert first.choices[0].finish_reason == "tool_calls"
    replay = [*question, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Booked for Monday 9:00."}]
    second = client.chat.completions.create(messages=replay, **{**base, "tool_choice": "none"})
    carried = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= (carried // bs - 1) * bs, (first.usage, second.usage)
