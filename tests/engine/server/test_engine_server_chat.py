"""engine.contract.chat: message normalization, tools, and the image placeholder/offset logic.

A small fake tokenizer (a jinja2 chat template and a word-level vocabulary) makes
the rendered text and the token positions easy to check exactly; the real
tokenizer is exercised through the HTTP tests.
"""

import base64
import json
import re

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from image_samples import png

from engine import hash_block_chain
from engine.contract.chat import PART_JOIN, ROLES, TOOLS_HEADER, ChatRenderer, ImagePlaceholder
from engine.contract.errors import APIError
from engine.contract.images import ImageData
from engine.contract.tool_call_format import CALL_INSTRUCTIONS

PLAIN_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}> {{ m.content }} </{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% if tools %}<tools> {% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
    + PLAIN_TEMPLATE
)
IMAGE_TOKEN = "<image>"


class FakeTokenizer:
    """Word-level: every whitespace-separated word gets the next free id; '<image>' is id 5."""

    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.vocab = {IMAGE_TOKEN: 5}
        self.calls = []

    def apply_chat_template(self, conversation, tools=None, add_generation_prompt=False, tokenize=True):
        assert tokenize is False
        self.calls.append({"conversation": conversation, "tools": tools})
        env = jinja2.Environment()
        return env.from_string(self.chat_template).render(
            messages=conversation, tools=tools, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text, add_special_tokens=True):
        words = re.findall(r"\S+", text)
        return [self.vocab.setdefault(w, len(self.vocab) + 100) for w in words]

    def __len__(self):
        return 1000


def image_url(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def image_id(data: bytes) -> str:
    return ImageData.from_bytes(data).sha256


def test_string_content_renders_through_the_template():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    prompt = ChatRenderer(tok).render([{"role": "user", "content": "hello there"}])
    assert tok.calls[0]["conversation"] == [{"role": "user", "content": "hello there"}]
    assert prompt.token_ids == tok.encode("<user> hello there </user>\n<assistant>")
    assert prompt.mm_items == ()


def test_text_parts_are_joined_with_one_newline_in_order():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": " b "}, {"type": "text", "text": "c"}]
    ChatRenderer(tok).render([{"role": "user", "content": parts}])
    assert tok.calls[0]["conversation"][0]["content"] == PART_JOIN.join(["a", " b ", "c"]) == "a\n b \nc"


def test_parts_and_the_equivalent_string_give_the_same_tokens():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    renderer = ChatRenderer(tok)
    parts = [{"type": "text", "text": "x y"}, {"type": "text", "text": "z"}]
    assert renderer.render([{"role": "user", "content": parts}]).token_ids == renderer.render(
        [{"role": "user", "content": "x y\nz"}]
    ).token_ids


def test_null_content_developer_role_and_tool_messages():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    ChatRenderer(tok).render(
        [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    conv = tok.calls[0]["conversation"]
    assert [m["role"] for m in conv] == ["system", "user", "assistant", "tool"]
    assert conv[2]["content"] == ""
    assert conv[3]["tool_call_id"] == "call_1"


def test_developer_role_is_kept_when_the_template_knows_it():
    tok = FakeTokenizer(PLAIN_TEMPLATE + "{# developer #}")
    ChatRenderer(tok).render([{"role": "developer", "content": "x"}])
    assert tok.calls[0]["conversation"][0]["role"] == "developer"


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]


def test_tools_go_to_a_template_that_supports_them():
    tok = FakeTokenizer(TOOLS_TEMPLATE)
    prompt = ChatRenderer(tok).render([{"role": "user", "content": "hi"}], TOOLS)
    assert tok.calls[0]["tools"] == TOOLS
    assert prompt.token_ids[:4] == tok.encode("<tools> get_weather get_time </tools>")


def test_tools_are_written_into_the_system_message_when_the_template_ignores_them():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    renderer = ChatRenderer(tok)
    renderer.render(
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "get_time"}}]},
        ],
        TOOLS,
    )
    conv = tok.calls[0]["conversation"]
    assert tok.calls[0]["tools"] is None
    lines = conv[0]["content"].split("\n")
    assert lines[0] == "sys" and lines[2] == TOOLS_HEADER
    assert '"name": "get_weather"' in lines[3] and '"name": "get_time"' in lines[4]
    assert lines[-1] == CALL_INSTRUCTIONS
    assert "tool_calls" not in conv[2]
    assert conv[2]["content"] == '<tool_call>{"name": "get_time", "arguments": null}</tool_call>'


def test_inlined_tools_change_the_prompt_and_their_order_matters():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    renderer = ChatRenderer(tok)
    messages = [{"role": "user", "content": "hi"}]
    plain = renderer.render(messages).token_ids
    forward = renderer.render(messages, TOOLS).token_ids
    again = renderer.render(messages, TOOLS).token_ids
    backward = renderer.render(messages, TOOLS[::-1]).token_ids
    assert forward == again
    assert forward != plain and forward != backward
    assert tok.calls[1]["conversation"][0]["role"] == "system"  # a new system message


def test_inlined_tools_and_tool_calls_ignore_json_key_order():
    def reorder(obj):
        if isinstance(obj, dict):
            return {k: reorder(obj[k]) for k in reversed(list(obj))}
        if isinstance(obj, list):
            return [reorder(v) for v in obj]
        return obj

    tok = FakeTokenizer(PLAIN_TEMPLATE)
    renderer = ChatRenderer(tok)
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    reordered = [messages[0], {**messages[1], "tool_calls": [reorder(call)]}]
    assert json.dumps(reorder(TOOLS)) != json.dumps(TOOLS)  # the key order really differs
    assert renderer.render(messages, TOOLS).token_ids == renderer.render(reordered, reorder(TOOLS)).token_ids


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "wizard", "content": "x"}, "messages[0].role"),
        ({"content": "x"}, "messages[0].role"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "audio"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": 1}]}, "messages[0].content[0]"),
        ({"role": "user", "content": ["plain string part"]}, "messages[0].content[0]"),
    ],
)
def test_bad_messages_are_400_naming_the_field(message, param):
    with pytest.raises(APIError) as info:
        ChatRenderer(FakeTokenizer(PLAIN_TEMPLATE)).render([message])
    assert info.value.status_code == 400
    assert info.value.param == param


def test_template_errors_become_400():
    tok = FakeTokenizer("{{ raise_me() }}")
    with pytest.raises(APIError) as info:
        ChatRenderer(tok).render([{"role": "user", "content": "x"}])
    assert info.value.status_code == 400 and info.value.param == "messages"


def test_a_text_only_model_refuses_images():
    with pytest.raises(APIError) as info:
        ChatRenderer(FakeTokenizer(PLAIN_TEMPLATE)).render(
            [{"role": "user", "content": [{"type": "text", "text": "see"}, image_url(png())]}]
        )
    assert info.value.status_code == 400
    assert "does not accept images" in info.value.message


# ----------------------------------------------------------- image-capable model
SPEC = ImagePlaceholder(text=IMAGE_TOKEN, token_id=5, tokens_per_image=6)


def image_renderer(tok, **kwargs):
    return ChatRenderer(tok, supports_images=True, image_placeholder=SPEC, **kwargs)


def test_each_image_expands_to_its_positions_and_is_named_by_its_sha256():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    img_a, img_b = png(seed=1), png(seed=2)
    content = [{"type": "text", "text": "look"}, image_url(img_a), {"type": "text", "text": "and"}, image_url(img_b)]
    prompt = image_renderer(tok).render([{"role": "user", "content": content}])
    rendered = tok.calls[0]["conversation"][0]["content"]
    assert rendered == "look\n<image>\nand\n<image>"
    a, b = prompt.mm_items
    assert a.identifier == image_id(img_a)
    assert b.identifier == image_id(img_b)
    assert a.identifier != b.identifier
    # "<user> look" precede the first image; "and" lies between the two.
    assert (a.offset, a.length) == (2, 6)
    assert (b.offset, b.length) == (2 + 6 + 1, 6)
    for item in (a, b):
        assert prompt.token_ids[item.offset : item.end] == [5] * 6
    assert prompt.token_ids.count(5) == 12
    unexpanded = tok.encode("<user> look <image> and <image> </user> <assistant>")
    assert len(prompt.token_ids) == len(unexpanded) + 2 * (6 - 1)


def test_the_image_bytes_enter_the_block_hashes():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    renderer = image_renderer(tok)

    def hashes(data):
        prompt = renderer.render([{"role": "user", "content": [image_url(data), {"type": "text", "text": "x"}]}])
        return hash_block_chain(prompt.token_ids, 4, mm_items=prompt.mm_items)

    same_1, same_2, other = hashes(png(seed=1)), hashes(png(seed=1)), hashes(png(seed=2))
    assert same_1 == same_2
    assert len(same_1) == len(other) >= 2
    assert same_1[0] != other[0]


def test_placeholder_typed_as_text_is_refused():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    with pytest.raises(APIError) as info:
        image_renderer(tok).render([{"role": "user", "content": [{"type": "text", "text": IMAGE_TOKEN}, image_url(png())]}])
    assert info.value.status_code == 400


def test_remote_image_refused_unless_allowed_and_then_fetched_by_the_given_function():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    remote = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    with pytest.raises(APIError) as info:
        image_renderer(tok).render([{"role": "user", "content": remote}])
    assert info.value.status_code == 400 and "remote" in info.value.message
    fetched = []
    renderer = image_renderer(tok, allow_remote_images=True, fetch=lambda url: fetched.append(url) or png(seed=9))
    prompt = renderer.render([{"role": "user", "content": remote}])
    assert fetched == ["https://example.com/a.png"]
    assert prompt.mm_items[0].identifier == image_id(png(seed=9))


def test_bad_data_url_is_400_naming_the_part():
    tok = FakeTokenizer(PLAIN_TEMPLATE)
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]
    with pytest.raises(APIError) as info:
        image_renderer(tok).render([{"role": "user", "content": bad}])
    assert info.value.param == "messages[0].content[0].image_url"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["type", "text", "image_url", "url", "x"]), inner, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from([*ROLES, "bogus"]) | JSON},
    optional={"content": JSON | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "video"])},
                                                                optional={"text": JSON, "image_url": JSON})),
              "name": JSON, "tool_calls": JSON, "tool_call_id": JSON},
)


@settings(max_examples=200, deadline=None)
@given(st.lists(MESSAGE, min_size=1, max_size=3), st.booleans())
def test_any_messages_render_or_are_refused_with_a_400(messages, images):
    renderer = image_renderer(FakeTokenizer(PLAIN_TEMPLATE)) if images else ChatRenderer(FakeTokenizer(PLAIN_TEMPLATE))
    try:
        prompt = renderer.render(messages)
    except APIError as err:
        assert err.status_code == 400 and err.message
        return
    assert all(isinstance(t, int) for t in prompt.token_ids)
