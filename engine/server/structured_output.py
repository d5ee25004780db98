"""ResponseFormat and the grammar a request's output must follow.

:func:`parse_response_format` validates ``response_format`` (chat) and
``text.format`` (Responses) and is the only place either is read.
:func:`grammar_for` decides the one grammar a request is constrained by, in this
order:

1. ``tool_choice`` ``required`` or a named function: the output is tool calls in
   the :mod:`engine.server.tool_calls` convention, the arguments constrained to
   each tool's ``parameters`` schema (several calls, one per line, unless
   ``parallel_tool_calls`` is false; a named function: exactly one call);
2. ``response_format`` ``json_schema``: JSON valid against the schema (``strict``
   or not: the grammar is always enforced, it cannot be partially honoured);
3. ``response_format`` ``json_object``: one JSON object;
4. otherwise none.

A schema the grammar library cannot compile, that no value can satisfy, or that
exceeds the library's limits is a 400 ``invalid_schema`` whose ``param`` points at
the schema (:func:`schema_param`) and whose message carries the reason. A limit
reached later, mid-generation, fails the request with the engine error
``GrammarError: ...`` (:data:`GRAMMAR_ERROR_PREFIX`), which the server answers
as the same client error, never a 5xx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.contract.errors import invalid_param
from engine.server.tool_calls import CALL_CLOSE, CALL_OPEN, ToolChoice

if TYPE_CHECKING:  # the gateway imports this package's protocol without torch or llguidance
    from engine.structured.grammar import CompiledGrammar, GrammarCompiler

MAX_SCHEMA_NAME_CHARS = 64
# How the engine reports engine.structured.grammar.GrammarError ("<type name>: <message>").
GRAMMAR_ERROR_PREFIX = "GrammarError: "


@dataclass(frozen=True)
class ResponseFormat:
    """``kind`` is "text", "json_object" or "json_schema" (then ``schema`` is set)."""

    kind: str
    schema: dict[str, Any] | None = None
    name: str | None = None
    param: str = "response_format"  # where the schema came from, for error messages


def parse_response_format(value: object, param: str = "response_format",
                          nested: bool = True) -> ResponseFormat | None:
    """Validate chat's ``response_format`` (``nested``: the schema sits under ``json_schema``)
    or the Responses API's ``text.format`` (flat: ``{"type", "name", "schema", "strict"}``)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid_param(f"'{param}' must be an object with a 'type'.", param)
    kind = value["type"]
    if kind in ("text", "json_object"):
        return ResponseFormat(kind, param=param)
    if kind != "json_schema":
        raise invalid_param(f"{param}.type must be 'text', 'json_object' or 'json_schema', "
                            f"got {kind!r}.", f"{param}.type")
    spec = value.get("json_schema") if nested else value
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict):
        raise invalid_param(f"'{where}' must be an object with 'name' and 'schema'.", where)
    name = spec.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_SCHEMA_NAME_CHARS:
        raise invalid_param(f"{where}.name must be a string of 1 to {MAX_SCHEMA_NAME_CHARS} "
                            "characters.", f"{where}.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid_param(f"{where}.schema must be a JSON schema object.", f"{where}.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_param(f"{where}.strict must be a boolean.", f"{where}.strict", "invalid_type")
    return ResponseFormat("json_schema", schema, name, param=f"{where}.schema")


def grammar_for(compiler: GrammarCompiler, tool_choice: ToolChoice,
                tools: list[dict[str, Any]] | None,
                response_format: ResponseFormat | None) -> CompiledGrammar | None:
    """The grammar the request's output must follow (see the module docstring), or None."""
    if tool_choice.forced:
        chosen = _forced_tools(tool_choice, tools)
        try:
            return compiler.tool_calls([(name, params) for _, name, params in chosen],
                                       open_tag=CALL_OPEN, close_tag=CALL_CLOSE,
                                       several=tool_choice.parallel and tool_choice.name is None)
        except ValueError as exc:
            raise invalid_param(f"The tool parameters schema cannot be enforced: {exc}",
                                schema_param(tool_choice, tools, response_format),
                                "invalid_schema") from exc
    if response_format is None or response_format.kind == "text":
        return None
    try:
        if response_format.kind == "json_object":
            return compiler.json_object()
        assert response_format.schema is not None
        return compiler.json_schema(response_format.schema)
    except ValueError as exc:
        raise invalid_param(f"The JSON schema cannot be enforced: {exc}", response_format.param,
                            "invalid_schema") from exc


def schema_param(tool_choice: ToolChoice, tools: list[dict[str, Any]] | None,
                 response_format: ResponseFormat | None) -> str | None:
    """The request field the grammar of :func:`grammar_for` comes from: the forced tool's
    ``parameters`` (``tools`` when several may be called), else the response format's schema."""
    if tool_choice.forced:
        chosen = _forced_tools(tool_choice, tools)
        return f"tools[{chosen[0][0]}].function.parameters" if len(chosen) == 1 else "tools"
    return None if response_format is None else response_format.param


def _forced_tools(tool_choice: ToolChoice,
                  tools: list[dict[str, Any]] | None) -> list[tuple[int, str, dict[str, Any]]]:
    """(index, name, parameters schema) of each tool a forced ``tool_choice`` may call."""
    chosen = []
    for i, tool in enumerate(tools or []):
        fn = tool["function"]
        if tool_choice.name is None or fn["name"] == tool_choice.name:
            chosen.append((i, fn["name"], fn.get("parameters") or {"type": "object", "properties": {}}))
    return chosen
