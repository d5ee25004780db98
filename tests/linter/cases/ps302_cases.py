"""PS302 cases: json.dumps without sort_keys of a dict whose key order varies, into a prompt (marked)."""

import json

LIMITS = {"free": 10, "pro": 100, "team": 1000}
PLANS = {"free", "pro", "team"}


def limits_from_a_set(enabled: set[str]) -> dict:
    limits = {name: LIMITS[name] for name in enabled}
    return {"role": "system", "content": "Limits: " + json.dumps(limits)}  # expect: PS302 at "json.dumps"


def module_level_set() -> str:
    quota = dict.fromkeys(PLANS, 0)
    system_prompt = f"Quotas: {json.dumps(quota, indent=2)}"  # expect: PS302 at "json.dumps"
    return system_prompt


def sort_keys_is_the_fix(enabled: set[str]) -> dict:
    limits = {name: LIMITS[name] for name in enabled}
    return {"role": "system", "content": "Limits: " + json.dumps(limits, sort_keys=True)}


def fixed_order_literal_is_stable() -> dict:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": "weather", "description": json.dumps(schema), "parameters": schema}}


def tool_result_is_history_not_prefix(call_id: str, result: dict) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}


def http_body_is_not_a_prompt(session, payload: dict) -> None:
    session.post("/v1/events", data=json.dumps(payload))


def log_line(log, record: dict) -> None:
    log.info(json.dumps({k: record[k] for k in set(record)}))
