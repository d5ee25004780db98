"""PS303 cases: sets or directory listings iterated into tools or instructions (marked)."""

import os

SPECS: dict[str, dict] = {}
UNITS = {"celsius", "fahrenheit", "kelvin"}


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


def description_from_module_set() -> dict:
    units = list(set(UNITS))  # expect: PS303 at "set(UNITS)"
    return {"type": "function", "function": {"name": "convert", "description": f"Units: {units}", "parameters": {}}}


def instructions_from_a_directory(folder: str) -> dict:
    names = os.listdir(folder)
    return {"role": "system", "content": "Files: " + ", ".join(names)}  # expect: PS303 at "names)"


def sorted_is_fine(enabled: set[str]) -> list[dict]:
    tools = [SPECS[n] for n in sorted(enabled)]
    return tools


def joined_sorted_is_fine() -> dict:
    return {"role": "system", "content": "Units: " + ", ".join(sorted(UNITS))}


def other_lists_are_fine(enabled: set[str]) -> list[str]:
    labels = [n.upper() for n in enabled]
    return labels


def membership_is_fine(name: str) -> dict:
    return {"role": "system", "content": f"Celsius allowed: {'celsius' in UNITS}, {len(UNITS)} units"}
