"""PML: the reader, the schema and prompt compilers, role glue, the registry, chat segments.

The compiled prompt's tokens must spell exactly the intended text; every refusal is a
PmlError (a ValueError) naming a line and column.
"""

from __future__ import annotations

import pytest

from engine.promptcache.chat_roles import role_template
from engine.promptcache.pml_compiler import PmlCompiler, PmlLimits
from engine.promptcache.pml_syntax import PmlError, parse_pml
from engine.promptcache.schema_registry import RegistryFull, SchemaRegistry
from engine.promptcache.segment_reuse import MIN_SEGMENT_TOKENS, chat_documents, segment_chat
from engine.promptcache.segments import Recovery

MAX_MODEL_LEN = 2048

SCHEMA = """<schema name="trip">
<system>You plan trips.</system>
<module name="plan"><user>Plan a trip of <param name="duration" len="5"/> to somewhere &amp; nice.</user></module>
<union>
  <module name="miami">Miami has beaches.</module>
  <module name="paris">Paris has museums &lt;and&gt; caf&#xe9;s.</module>
</union>
<module name="book">Book: <module name="ch1">Chapter one.</module><module name="ch2">Chapter two.</module> end.</module>
</schema>"""

ZEPHYR = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def compiler(bundled_tokenizer):
    return PmlCompiler(bundled_tokenizer, PmlLimits(max_param_tokens=MAX_MODEL_LEN))


@pytest.fixture
def zephyr_tokenizer(bundled_tokenizer):
    import copy

    tok = copy.deepcopy(bundled_tokenizer)
    tok.chat_template = ZEPHYR
    return tok


def _text(tok, ids) -> str:
    return tok.decode(list(ids))


def test_schema_modules_and_tokens(compiler, bundled_tokenizer):
    schema = compiler.schema(SCHEMA)
    paths = [m.path for m in schema.modules()]
    assert paths == ["plan", "miami", "paris", "book", "book/ch1", "book/ch2"]
    paris = next(m for m in schema.modules() if m.path == "paris")
    assert paris.tokens == len(bundled_tokenizer.encode("Paris has museums <and> cafés.", add_special_tokens=False))
    assert schema.total_tokens == len(schema.preamble) + sum(m.tokens for m in schema.modules())


def test_prompt_tokens_spell_the_intended_text(compiler, bundled_tokenizer):
    schema = compiler.schema(SCHEMA)
    prompt = compiler.prompt(
        '<prompt schema="trip"><plan duration="3 days"/><user><paris/><book><ch2/></book>Highlights?</user>'
        '<assistant/></prompt>', {"trip": schema}.get)
    expected = bundled_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You plan trips."},
         {"role": "user", "content": "Plan a trip of 3 days to somewhere & nice."},
         {"role": "user", "content": "Paris has museums <and> cafés.Book: Chapter two. end.Highlights?"}],
        tokenize=False, add_generation_prompt=True)
    assert _text(bundled_tokenizer, prompt.token_ids) == expected
    names = [s.module for s in prompt.segments]
    assert names == ["trip/@preamble", "trip/plan", None, "trip/plan#1", None, "trip/paris", "trip/book",
                     "trip/book/ch2", "trip/book#1", None]
    assert _text(bundled_tokenizer, prompt.segments[2].token_ids) == "3 days"  # the argument is uncached
    assert prompt.recovery == Recovery()
    # The module's pieces are the schema's tokens, whatever the prompt around them.
    again = compiler.prompt('<prompt schema="trip"><paris/>x</prompt>', {"trip": schema}.get,
                            Recovery("none"))
    assert again.segments[1].token_ids == prompt.segments[5].token_ids
    assert again.recovery.mode == "none"


def test_prompt_order_is_the_prompts(compiler, bundled_tokenizer):
    schema = compiler.schema('<schema name="d"><module name="a">Alpha.</module><module name="b">Beta.</module>'
                             '</schema>')
    ab = compiler.prompt('<prompt schema="d"><a/><b/>Q</prompt>', {"d": schema}.get)
    ba = compiler.prompt('<prompt schema="d"><b/><a/>Q</prompt>', {"d": schema}.get)
    assert _text(bundled_tokenizer, ab.token_ids) == "Alpha.Beta.Q"
    assert _text(bundled_tokenizer, ba.token_ids) == "Beta.Alpha.Q"
    assert ab.num_module_tokens == ba.num_module_tokens > 0


def test_role_glue_chatml(bundled_tokenizer):
    roles = role_template(bundled_tokenizer)
    assert roles.prefix["user"] == "<|im_start|>user\n"
    assert roles.suffix["assistant"] == "<|im_end|>\n"
    assert roles.generation == "<|im_start|>assistant\n"


def test_role_glue_another_template(zephyr_tokenizer):
    compiler = PmlCompiler(zephyr_tokenizer, PmlLimits(max_param_tokens=MAX_MODEL_LEN))
    schema = compiler.schema('<schema name="z"><system>Be brief.</system>'
                             '<module name="doc"><user>The document.</user></module></schema>')
    prompt = compiler.prompt('<prompt schema="z"><doc/><user>Why?</user><assistant/></prompt>', {"z": schema}.get)
    expected = zephyr_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The document."},
         {"role": "user", "content": "Why?"}], tokenize=False, add_generation_prompt=True)
    assert expected.startswith("<|system|>\n")
    assert _text(zephyr_tokenizer, prompt.token_ids) == expected


def test_non_compositional_template_refuses_role_tags(bundled_tokenizer):
    import copy

    tok = copy.deepcopy(bundled_tokenizer)  # the system text moves into the first user turn (Llama 2 style)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'system' %}{% set sys = m.content %}"
                         "{% else %}[{{ m.role }}] {{ m.content }} {% endif %}{% endfor %}")
    compiler = PmlCompiler(tok, PmlLimits(max_param_tokens=64))
    with pytest.raises(PmlError, match="cannot be used with this model"):
        compiler.schema('<schema name="s"><module name="m"><user>x</user></module></schema>')
    assert compiler.schema('<schema name="s"><module name="m">x</module></schema>').name == "s"  # no roles: fine


SELF = '<schema name="s"><module name="a">x<a/></module></schema>'
LAUGHS = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;">]>'
          '<schema name="s"><module name="a">&lol2;</module></schema>')


@pytest.mark.parametrize("source, fragment", [
    ("<schema name='s'>" + "<module name='m'>" * 40 + "x" + "</module>" * 40 + "</schema>", "nested more than"),
    ('<schema name="s"><module name="a"><param name="p" len="1000000000"/></module></schema>', "param len"),
    ("<schema name='s'>" + "".join(f"<module name='m{i}'>x</module>" for i in range(10_000)) + "</schema>",
     "more than"),
    ('<schema name="s"><module name="a"><frobnicate/></module></schema>', "unknown tag <frobnicate>"),
    ('<schema name="s"><blink/></schema>', "unknown tag <blink>"),
    (SELF, "refers to itself"),
    (LAUGHS, "not allowed"),
    ('<schema name="s"><module name="a">&lol;</module></schema>', "unknown entity"),
    ('<schema name="s"><module name="a">a & b</module></schema>', "&amp;"),
    ('<schema name="s"><module name="a">x</module>', "not closed"),
    ('<schema name="s"><module name="a">x</union></schema>', "does not close"),
    ('<schema name="s" name="t"></schema>', "twice"),
    ('<schema name="prompt"></schema>', "PML tag name"),
    ('<schema name="s"><module name="a">x</module><module name="a">y</module></schema>', "declared twice"),
    ('<schema name="s"><module name="a"><param name="p" len="x"/></module></schema>', "len=N"),
    ('<schema name="s"><module name="a">x</module>trailing</schema>', "after the first module"),
    ('<schema name="s"><union>text</union></schema>', "only modules"),
    ('<schema name="s"><module name="a"><user><system>x</system></user></module></schema>', "inside another role"),
    ('<schema name="s"><param name="p" len="3"/></schema>', "unknown tag <param>"),
    ("<schema name='" + "n" * 100 + "'/>", "at most 64"),
    ('<schema/>', "needs a name"),
    ('<prompt schema="s"/>', "expected <schema"),
    ("", "expected a root element"),
    ('<schema name="s"></schema><schema name="t"></schema>', "follow the root"),
    ('<schema name="s">\x00</schema>', "NUL"),
])
def test_hostile_schemas_are_refused_with_a_position(compiler, source, fragment):
    with pytest.raises(PmlError) as info:
        compiler.schema(source)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)
    assert info.value.line >= 1 and info.value.column >= 1
    assert f"line {info.value.line}, column {info.value.column}" in str(info.value)


@pytest.mark.parametrize("source, fragment", [
    ('<prompt schema="nope"><a/></prompt>', "unknown schema"),
    ('<prompt schema="trip"><rome/></prompt>', "no module 'rome'"),
    ('<prompt schema="trip"><miami/><paris/></prompt>', "one union"),
    ('<prompt schema="trip"><paris/><paris/></prompt>', "imported twice"),
    ('<prompt schema="trip"><plan duration="one two three four five six seven eight"/></prompt>', "more than its len"),
    ('<prompt schema="trip"><plan days="3"/></prompt>', "no param 'days'"),
    ('<prompt schema="trip"><book><ch9/></book></prompt>', "no nested module 'ch9'"),
    ('<prompt schema="trip"><book>text</book></prompt>', "text inside the import"),
    ('<prompt schema="trip"><book><book/></book></prompt>', "no nested module 'book'"),
    ('<prompt><paris/></prompt>', "needs a schema"),
])
def test_bad_prompts_are_refused_with_a_position(compiler, source, fragment):
    schemas = {"trip": compiler.schema(SCHEMA)}
    with pytest.raises(PmlError) as info:
        compiler.prompt(source, schemas.get)
    assert fragment in str(info.value)


def test_error_position_is_line_and_column(compiler):
    with pytest.raises(PmlError) as info:
        compiler.schema('<schema name="s">\n  <module name="a">\n    <oops/>\n  </module>\n</schema>')
    assert (info.value.line, info.value.column) == (3, 5)


def test_parser_keeps_text_and_cdata():
    root = parse_pml('<prompt schema="s">a<![CDATA[<b> & c]]><!-- note -->d &#65;</prompt>')
    assert root.children[0].text == "a<b> & cd A"


def test_registry_is_per_salt_and_bounded(compiler):
    registry = SchemaRegistry(max_schemas=2, max_tokens=10_000, max_salts=2)
    trip = compiler.schema(SCHEMA)
    registry.put("tenant-a", trip)
    assert registry.get("tenant-b", "trip") is None and registry.list(None) == []
    assert registry.get("tenant-a", "trip") is trip
    registry.put("tenant-a", trip)  # replacing is not a second schema
    other = compiler.schema('<schema name="other"><module name="m">x</module></schema>')
    registry.put("tenant-a", other)
    third = compiler.schema('<schema name="third"><module name="m">x</module></schema>')
    with pytest.raises(RegistryFull):
        registry.put("tenant-a", third)
    registry.put(None, third)
    with pytest.raises(RegistryFull) as full:
        registry.put("tenant-c", third)
    assert not full.value.per_salt
    assert not registry.delete("tenant-b", "trip")
    assert registry.delete("tenant-a", "trip")
    registry.check_integrity()
    small = SchemaRegistry(max_tokens=trip.total_tokens - 1)
    with pytest.raises(RegistryFull):
        small.put(None, trip)
    overall = SchemaRegistry(max_total_tokens=trip.total_tokens + other.total_tokens)
    overall.put("a", trip)
    overall.put("b", other)
    overall.put("b", other)  # replacing counts once
    with pytest.raises(RegistryFull) as full:  # "c" would hold as much as the most any other holds
        overall.put("c", trip)
    assert not full.value.per_salt and overall.get("a", "trip") is trip and overall.evicted == 0
    assert overall.delete("a", "trip")
    overall.put("c", third)
    overall.check_integrity()


def _sized(compiler, name: str, words: int):
    return compiler.schema(f'<schema name="{name}"><module name="m">{"word " * words}</module></schema>')


def test_full_registry_evicts_the_heaviest_owner_never_a_newcomer_under_its_share(compiler):
    # One tenant varies its salt to take every namespace: it stays one owner, and a
    # newcomer's registration evicts that tenant's oldest namespace instead of failing.
    registry = SchemaRegistry(max_salts=4)
    small = _sized(compiler, "s", 3)
    for i in range(4):
        registry.put(f"greedy-{i}", small, tenant="greedy")
    registry.put("alice-0", small, tenant="alice")
    assert registry.get("greedy-0", "s") is None and registry.get("greedy-1", "s") is small
    assert registry.get("alice-0", "s") is small and registry.evicted == 1
    registry.put("bob-0", small, tenant="bob")  # greedy (3 salts) still holds the most
    assert registry.owner_usage()[("tenant", "greedy")][0] == 2
    registry.put("carol-0", small, tenant="carol")
    # Four owners, one salt each: the fair share is reached, so a fifth is refused and nothing is evicted.
    with pytest.raises(RegistryFull) as full:
        registry.put("dave-0", small, tenant="dave")
    assert not full.value.per_salt and registry.evicted == 3
    # Greedy may not take back a namespace from anyone holding no more than it would.
    with pytest.raises(RegistryFull):
        registry.put("greedy-9", small, tenant="greedy")
    registry.put("greedy-3", _sized(compiler, "t", 2), tenant="greedy")  # its own namespaces still take schemas
    registry.check_integrity()

    # The token bound: the owner holding the most tokens loses its oldest schemas first.
    big, medium = _sized(compiler, "big", 60), _sized(compiler, "medium", 20)
    tokens = SchemaRegistry(max_total_tokens=3 * big.total_tokens)
    for i in range(3):
        tokens.put(f"greedy-{i}", big, tenant="greedy")
    tokens.put("alice", medium, tenant="alice")
    assert tokens.get("greedy-0", "big") is None and tokens.get("greedy-1", "big") is big
    assert tokens.get("alice", "medium") is medium
    with pytest.raises(RegistryFull):  # alice would then hold more than greedy: refused, nothing evicted
        tokens.put("alice", _sized(compiler, "huge", 140), tenant="alice")
    assert tokens.get("greedy-1", "big") is big and tokens.evicted == 1
    # A salt created by one tenant stays that tenant's, whoever registers into it later.
    tokens.put("alice", small, tenant="greedy")
    assert tokens.owner_usage()[("tenant", "alice")] == (1, medium.total_tokens + small.total_tokens)
    assert tokens.delete("alice", "medium") and tokens.delete("alice", "s")
    assert ("tenant", "alice") not in tokens.owner_usage()
    tokens.check_integrity()


def test_segment_chat_is_the_normal_prompt(bundled_tokenizer):
    doc = "The quick brown fox jumps over the lazy dog. " * 4
    messages = [{"role": "system", "content": "Short."},
                {"role": "user", "content": [{"type": "text", "text": doc}, {"type": "text", "text": "Tiny?"}]},
                {"role": "assistant", "content": doc.upper()}, {"role": "user", "content": "What?"}]
    rendered = bundled_tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
          else "\n\n".join(p["text"] for p in m["content"])} for m in messages],
        tokenize=False, add_generation_prompt=True)
    ids = bundled_tokenizer.encode(rendered, add_special_tokens=False)
    seg = segment_chat(bundled_tokenizer, rendered, ids, chat_documents(messages))
    assert seg is not None and seg.token_ids == ids
    reused = [s for s in seg.segments if s.module == "segment"]
    assert len(reused) == 2 and all(len(s.token_ids) >= MIN_SEGMENT_TOKENS for s in reused)
    assert doc.strip() in bundled_tokenizer.decode(list(reused[0].token_ids))
    assert segment_chat(bundled_tokenizer, rendered, ids, ["short", "What?"]) is None
    assert segment_chat(bundled_tokenizer, rendered, ids[:-1], chat_documents(messages)) is None
