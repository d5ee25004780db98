"""Tool definitions gathered from registries, plugins and user accounts (labelled)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UNITS = {"celsius", "fahrenheit"}
CURRENCIES = ["EUR", "USD", "GBP"]


def weather_tool() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": list(UNITS)}},  # expect: PS303
                "required": ["city"],
            },
        },
    }


def convert_tool() -> dict[str, Any]:
    schema = {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"type": "string", "enum": CURRENCIES}}}
    return {"type": "function", "function": {"name": "convert", "description": "Convert money. Schema: " + json.dumps(schema), "parameters": schema}}


RATE_LIMITS = {"celsius": 60, "fahrenheit": 60}


def limits_tool() -> dict[str, Any]:
    limits = {unit: RATE_LIMITS[unit] for unit in UNITS}
    return {"type": "function", "function": {"name": "limits", "description": "Rate limits: " + json.dumps(limits), "parameters": {}}}  # expect: PS302


def member_search_tool(member_id: str) -> dict[str, Any]:
    return {"name": "search", "description": "Search saved items.", "parameters": {"type": "object", "properties": {"owner": {"const": "member-" + member_id}}}}  # expect: PS304


def plugin_tools(plugin_dir: Path) -> list[dict[str, Any]]:
    tools = []
    for path in plugin_dir.glob("*.json"):  # expect: PS303
        tools.append(json.loads(path.read_text(encoding="utf-8")))
    return tools


def plugin_tools_sorted(plugin_dir: Path) -> list[dict[str, Any]]:
    tools = []
    for path in sorted(plugin_dir.glob("*.json")):
        tools.append(json.loads(path.read_text(encoding="utf-8")))
    return tools


def account_tools(account: Any) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": "list_invoices",
                "description": f"List the invoices of {account.company_name}.",  # expect: PS304
                "parameters": {"type": "object", "properties": {"year": {"type": "integer"}}},
            },
        }
    ]


def list_invoices(account: Any, year: int) -> str:
    invoices = account.invoices(year)
    return json.dumps({"account": account.company_name, "invoices": invoices})
