"""PS303 cases: tools built by iterating a set (marked) and ordered alternatives."""

SPECS: dict[str, dict] = {}


def from_set_literal() -> list[dict]:
    tools = [SPECS[n] for n in {"a", "b"}]  # expect: PS303 at "{"a", "b"}"
    return tools


def from_annotated_parameter(enabled: set[str]) -> list[dict]:
    tools = [SPECS[n] for n in enabled]  # expect: PS303 at "enabled]"
    return tools


def from_set_variable(extra: list[str]) -> list[dict]:
    names = set(extra) | {"search"}
    functions = list(names)  # expect: PS303 at "names)"
    return functions


def loop_append(extra: list[str]) -> list[dict]:
    tools = []
    for name in frozenset(extra):  # expect: PS303 at "frozenset"
        tools.append(SPECS[name])
    return tools


def keyword(client, enabled: set[str]) -> None:
    client.create(tools=[SPECS[n] for n in enabled])  # expect: PS303 at "enabled]"


def sorted_is_fine(enabled: set[str]) -> list[dict]:
    tools = [SPECS[n] for n in sorted(enabled)]
    return tools


def other_lists_are_fine(enabled: set[str]) -> list[str]:
    labels = [n.upper() for n in enabled]
    return labels
