"""How a tool call is written in a prompt: the Hermes tags, the instruction that asks for them,
and an assistant message's call written back the same way.

The chat renderer (:mod:`engine.contract.chat`) writes with these, so the gateway's block
keys see the prompt the engine runs; the engine's parser (:mod:`engine.server.tool_calls`)
reads calls back with the same tags.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
CALL_INSTRUCTIONS = (
    "To call a tool, answer only with one line per call, in this exact form: "
    f'{CALL_OPEN}{{"name": "<tool name>", "arguments": {{<arguments as JSON>}}}}{CALL_CLOSE}'
)

def render_call(call: dict[str, Any]) -> str:
    """An assistant message's tool call, written back in the convention above: ``name``
    then ``arguments``, the arguments' members in their order, ``json.dumps``'s default
    spacing. A call the model wrote in the convention thus renders as the very tokens it
    generated, and the next turn's prompt continues the cached prefix through it."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return json.dumps(call, ensure_ascii=False, sort_keys=True)
    args: Any = fn.get("arguments")
    if isinstance(args, str):
        with contextlib.suppress(ValueError):
            args = json.loads(args)
    body = {"name": fn.get("name"), "arguments": args}
    return CALL_OPEN + json.dumps(body, ensure_ascii=False) + CALL_CLOSE
