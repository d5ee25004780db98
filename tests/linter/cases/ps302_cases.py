"""PS302 cases: json.dumps without sort_keys building prompt text (marked) and harmless uses."""

import json


def fstring(schema: dict) -> str:
    return f"Schema: {json.dumps(schema)}"  # expect: PS302 at "json.dumps"


def concat(schema: dict) -> str:
    return "Schema: " + json.dumps(schema, indent=2)  # expect: PS302 at "json.dumps"


def tool_result(result: dict) -> dict:
    return {"role": "tool", "content": json.dumps(result)}  # expect: PS302 at "json.dumps"


def named(result: dict) -> str:
    prompt_suffix = json.dumps(result)  # expect: PS302 at "json.dumps"
    return prompt_suffix


def build_prompt(data: dict) -> str:
    return json.dumps(data)  # expect: PS302 at "json.dumps"


def sorted_is_fine(schema: dict) -> str:
    return f"Schema: {json.dumps(schema, sort_keys=True)}"


def unrelated_file_write(data: dict, path: str) -> None:
    with open(path, "w") as fh:
        fh.write(json.dumps(data))


def explicit_false(data: dict) -> dict:
    return {"content": json.dumps(data, sort_keys=False)}  # expect: PS302 at "json.dumps"


def jsonl_line(record: dict) -> str:
    return json.dumps(record) + "\n"


def sse_event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def template(system: str, tools: list) -> str:
    return f"{system}\n{json.dumps(tools)}"  # expect: PS302 at "json.dumps"
