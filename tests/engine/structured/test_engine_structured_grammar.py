"""engine.structured: schemas no value satisfies and schemas over llguidance's limits are
refused at compile time; a limit reached mid-generation is a GrammarError."""

import pytest

from engine.server.structured_output import GRAMMAR_ERROR_PREFIX
from engine.structured.grammar import GrammarCompiler, GrammarError, closed
from engine.structured.satisfiable import unsatisfiable

SELF = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                        "required": ["c"]}}, "$ref": "#/$defs/n"}


@pytest.mark.parametrize("schema", [
    False,
    SELF,
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"$ref": "#/$defs/n"}},
     "required": ["a", "b"], "$defs": SELF["$defs"]},  # the loop comes after free text
    {"$defs": {"n": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/n"}}},
     "$ref": "#/$defs/n"},
    {"type": "object", "required": ["x"], "properties": {}, "additionalProperties": False},
    {"$defs": SELF["$defs"], "anyOf": [{"$ref": "#/$defs/n"}, False]},
    {"allOf": [{"type": "string"}, False]},
    {"type": ["object"], "properties": {"x": False}, "required": ["x"]},
])
def test_schemas_without_a_finite_instance_are_found(schema):
    assert unsatisfiable(schema) is not None


@pytest.mark.parametrize("schema", [
    True, {},
    {"$defs": {"n": {"properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
     "$ref": "#/$defs/n"},  # no type: {"c": 1} satisfies it
    {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n"},  # c is optional
    {"$defs": {"n": {"type": "object", "required": ["c"], "properties": {
        "c": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}, "$ref": "#/$defs/n"},
    {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"},
    {"$ref": "https://example.com/schema.json"},
    {"$ref": "#/$defs/missing"},
])
def test_satisfiable_or_undecided_schemas_pass(schema):
    assert unsatisfiable(schema) is None


def test_the_walk_is_bounded_on_deep_schemas():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert unsatisfiable(deep) is None  # too deep to decide: not refused, no RecursionError


@pytest.fixture(scope="module")
def compiler(bundled_tokenizer):
    return GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer))


@pytest.mark.parametrize(("schema", "says"), [
    (SELF, "cannot be satisfied"),
    ({"type": "string", "pattern": "^a{1000000}$"}, "too many expressions"),
])
def test_compile_refuses_unsatisfiable_and_over_limit_schemas(compiler, schema, says):
    for _ in range(2):  # the second refusal comes from the cache, with the same message
        with pytest.raises(ValueError, match=says) as info:
            compiler.json_schema(schema)
        assert "<state>" not in str(info.value)  # no parser dump, one line
    with pytest.raises(ValueError, match="cannot be satisfied"):
        compiler.tool_calls([("f", SELF)], open_tag="<a>", close_tag="</a>", several=False)


def test_ordinary_schemas_still_compile(compiler):
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^a{50}$"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name"]}
    assert compiler.json_schema(schema).grammar
    assert closed(schema)["additionalProperties"] is False


def test_a_token_the_grammar_cannot_take_is_a_grammar_error(compiler, bundled_tokenizer):
    constraint = compiler.constraint(compiler.json_schema({"type": "integer"}))
    with pytest.raises(GrammarError) as info:
        constraint.accept(bundled_tokenizer.encode("x")[0])
    assert "\n" not in str(info.value)
    assert f"{GrammarError.__name__}: " == GRAMMAR_ERROR_PREFIX  # how the engine reports it
