"""The gateway's token ids equal the engine's, request for request.

The engine renders with ``engine.contract.chat.ChatRenderer`` over a ``transformers``
tokenizer; the gateway over ``engine.contract.chat_tokenizer.ChatTokenizer`` (tokenizers +
jinja2). Both are run on the same requests: the bundled SmolLM2 template (which
ignores tools, so they are inlined) and a tools-aware template written into a copy
of the model directory (so the template path with ``tools`` and ``tojson`` runs).
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.contract.chat import ChatRenderer
from engine.contract.chat_tokenizer import ChatTokenizer
from gateway.routing.block_keys import BlockKeyer

pytestmark = pytest.mark.real_model

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
  {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
  {%- if message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
  {% elif message.tool_calls is defined %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson(indent=2) }}</tool_call>{% endfor %}<|im_end|>
  {% else %}<|im_start|>{{ message.role }}{% if message.name is defined %} ({{ message.name }}){% endif %}
{{ message.content }}<|im_end|>
  {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}{{ bos_token if false }}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather für eine Stadt <b>",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"function": {"parameters": {"properties": {}, "type": "object"}, "name": "now"}, "type": "function"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}


def _requests() -> list[dict[str, Any]]:
    systems = [None, "You are terse.", "Système: réponds en français. 日本語も。", "  spaces \n\n and <|im_start|> inside "]
    users: list[Any] = [
        "Hi", "What's the weather in Oslo?\nAnd in Bergen?", "",
        [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        [{"type": "text", "text": "only part"}],
        [{"type": "text", "text": ""}, {"type": "text", "text": "after empty"}],
    ]
    tool_sets: list[Any] = [None, [WEATHER], [CLOCK, WEATHER]]
    out = []
    for system, user, tools in itertools.product(systems, users, tool_sets):
        messages: list[dict[str, Any]] = []
        if system is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": user})
        out.append({"messages": messages, "tools": tools})
    multi_turn = [
        {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": "weather?", "name": "alice"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
        {"role": "assistant", "content": "It is 3 degrees."},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}, {"type": "text", "text": "and tomorrow?"}]},
    ]
    for n in range(2, len(multi_turn) + 1):
        for tools in tool_sets:
            out.append({"messages": multi_turn[:n], "tools": tools})
    return out


REQUESTS = _requests()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from engine.model_store import ensure_converted_model

    return ensure_converted_model()


@pytest.fixture(scope="module")
def tools_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tools-model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    (out / "chat_template.jinja").write_text(TOOLS_TEMPLATE, "utf-8")
    return out


def _engine_renderer(path: Path) -> ChatRenderer:
    from transformers import AutoTokenizer

    return ChatRenderer(AutoTokenizer.from_pretrained(str(path), local_files_only=True))


@pytest.mark.parametrize("which", ["bundled", "tools_template"])
def test_gateway_token_ids_equal_the_engines(which: str, model_dir: Path, tools_model_dir: Path) -> None:
    path = model_dir if which == "bundled" else tools_model_dir
    engine = _engine_renderer(path)
    keyer = BlockKeyer(ChatTokenizer(path))
    assert engine.template_has_tools == (which == "tools_template") == keyer.renderer.template_has_tools
    compared = 0
    for request in REQUESTS:
        expected = engine.render(request["messages"], request["tools"]).token_ids
        body = {"model": "m", "messages": request["messages"]}
        if request["tools"] is not None:
            body["tools"] = request["tools"]
        assert keyer.token_ids("chat.completions", body) == expected, json.dumps(request)
        compared += 1
    assert compared == len(REQUESTS) > 80


def test_completion_prompts_and_token_id_prompts(model_dir: Path) -> None:
    engine = _engine_renderer(model_dir)
    keyer = BlockKeyer(ChatTokenizer(model_dir))
    for prompt in ["Once upon a time", "<|im_start|>user\nhi<|im_end|>", "x" * 300, " leading space"]:
        assert keyer.token_ids("completions", {"prompt": prompt}) == engine.encode(prompt)
    assert keyer.token_ids("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]


def test_keys_chain_over_salt_and_cap_the_last_token(model_dir: Path) -> None:
    keyer = BlockKeyer(ChatTokenizer(model_dir))
    body = {"messages": [{"role": "system", "content": "word " * 100}, {"role": "user", "content": "q"}]}
    a = keyer.keys("chat.completions", body, "salt-a")
    b = keyer.keys("chat.completions", body, "salt-b")
    plain = keyer.keys("chat.completions", body, None)
    assert a is not None and b is not None and plain is not None
    assert a.num_tokens == b.num_tokens and len(a.keys) == a.num_tokens // 16 > 3
    assert not set(a.keys) & set(b.keys) and not set(a.keys) & set(plain.keys)
    assert a.max_hit_blocks == (a.num_tokens - 1) // 16


def test_requests_that_cannot_be_tokenized_have_no_keys(model_dir: Path) -> None:
    keyer = BlockKeyer(ChatTokenizer(model_dir))
    assert keyer.keys("chat.completions", {"messages": [{"role": "wizard", "content": "x"}]}, None) is None
    assert keyer.keys("chat.completions", {"messages": []}, None) is None
    assert keyer.keys("completions", {"prompt": [-1]}, None) is None


def test_missing_files_are_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        ChatTokenizer(tmp_path)


def _image(seed: int) -> dict[str, Any]:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8), (seed, 2 * seed, 3)).save(out, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()}}


HISTORY = [{"role": "system", "content": "You describe product photos for a catalogue. " * 6},
           {"role": "user", "content": "Hello, I have a few photos."}, {"role": "assistant", "content": "Send them."}]


@pytest.mark.parametrize("content", [
    lambda img: [img],
    lambda img: [{"type": "text", "text": "What is this?"}, img],
    lambda img: [{"type": "text", "text": "Compare"}, img, {"type": "text", "text": "with"}, _image(99)],
], ids=["image-only", "text-then-image", "two-images"])
def test_image_requests_get_the_engines_keys_up_to_the_message_of_their_first_image(model_dir: Path, content) -> None:
    from transformers import AutoTokenizer

    from engine import hash_block_chain
    from engine.contract.chat import ImagePlaceholder

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    placeholder = ImagePlaceholder("<jupyter_text>", tokenizer.convert_tokens_to_ids("<jupyter_text>"), 40)
    engine = ChatRenderer(tokenizer, supports_images=True, image_placeholder=placeholder)
    keyer = BlockKeyer(ChatTokenizer(model_dir))
    chains = []
    for seed in (1, 2):
        messages = [*HISTORY, {"role": "user", "content": content(_image(seed))},
                    {"role": "assistant", "content": "A red mug."}, {"role": "user", "content": "And the handle?"}]
        prompt = engine.render(messages)
        first = prompt.mm_items[0]
        engine_keys = hash_block_chain(prompt.token_ids, 16, cache_salt="s", mm_items=prompt.mm_items)
        keys = keyer.keys("chat.completions", {"messages": messages}, "s")
        assert keys is not None and keyer.token_ids("chat.completions", {"messages": messages}) is None
        assert keys.keys == tuple(engine_keys[: len(keys.keys)])  # exactly the engine's blocks
        before = keys.num_tokens - 1  # the tokens the gateway kept: up to the image's message
        assert len(engine.render(HISTORY).token_ids) - 4 <= before <= first.offset
        assert len(keys.keys) == before // 16 <= first.offset // 16  # no key for a block the image overlaps
        assert keys.max_hit_blocks == len(keys.keys) >= 3
        chains.append((keys.keys, engine_keys, first.offset))
    (gw_a, engine_a, offset), (gw_b, engine_b, _) = chains
    assert gw_a == gw_b  # the image never enters the gateway's keys
    shared = next(i for i, (x, y) in enumerate(zip(engine_a, engine_b, strict=False)) if x != y)
    assert shared == offset // 16  # the engine's chains part at the image's first block


def test_a_responses_input_image_is_keyed_like_the_chat_image(model_dir: Path) -> None:
    keyer = BlockKeyer(ChatTokenizer(model_dir))
    url = _image(5)["image_url"]["url"]
    chat = {"messages": [*HISTORY, {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                                _image(5)]}]}
    responses = {"input": [*HISTORY, {"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": url, "detail": "auto"}]}]}
    a, b = keyer.keys("chat.completions", chat, "s"), keyer.keys("responses", responses, "s")
    assert a is not None and a == b and len(a.keys) >= 3
