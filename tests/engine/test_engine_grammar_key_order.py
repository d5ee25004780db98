"""The grammar cache keeps the order of a schema's fields: two orders are two grammars.

Constrained decoding writes an object's fields in the schema's order, so a cache keyed by
sorted JSON handed the first order's grammar to every later order (and a canonicalization
check with and without a key-sorting step could not see a difference)."""

from __future__ import annotations

import json

from engine.structured.grammar import GrammarCompiler


def _schema(*fields: str) -> dict:
    return {"type": "object", "properties": {f: {"type": "string"} for f in fields}, "required": list(fields)}


def test_field_order_is_part_of_the_cache_key(bundled_tokenizer):
    compiler = GrammarCompiler(bundled_tokenizer, len(bundled_tokenizer))
    first = compiler.json_schema(_schema("name", "species"))
    swapped = compiler.json_schema(_schema("species", "name"))
    assert first is not swapped and first.grammar != swapped.grammar
    assert compiler.json_schema(_schema("name", "species")) is first  # still cached
    # keyword order carries no meaning here: the same properties in a reordered schema object
    reordered = dict(reversed(list(_schema("name", "species").items())))
    assert json.dumps(reordered) != json.dumps(_schema("name", "species"))
    assert compiler.json_schema(reordered).grammar.index("name") < compiler.json_schema(reordered).grammar.index("species")
