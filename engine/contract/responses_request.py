"""The Responses API's request as a chat request: one translation for the engine and the gateway.

:func:`to_chat_body` turns a Responses request into the chat request the rest of
the server already validates, renders and runs:

* ``instructions`` becomes a leading system message; ``input`` is a string (one
  user message) or items: messages (``role`` + string or ``input_text`` /
  ``output_text`` / ``input_image`` parts; an ``input_image``'s ``image_url``, a URL
  or a ``data:`` URL, and its ``detail`` become chat's ``image_url`` part, so images
  take the one chat path; ``file_id`` is a 400), ``function_call`` items (an assistant message's
  ``tool_calls``, consecutive calls in one message) and ``function_call_output``
  items (``tool`` messages);
* function ``tools`` (flat: ``{"type": "function", "name", "parameters"}``) and
  ``tool_choice`` become chat's nested form; other tool types are a 400;
* ``text.format`` becomes ``response_format`` (``json_schema`` is flat here);
* ``max_output_tokens`` becomes ``max_completion_tokens``;
* ``top_logprobs`` (or ``include: ["message.output_text.logprobs"]``) turns chat's
  ``logprobs`` on; the text parts then carry OpenAI's ``logprobs`` entries;
* ``store: true`` and ``previous_response_id`` are a 400: nothing is stored, so
  there is nothing to continue from (clients must send ``store: false`` and the
  whole conversation). ``store`` defaults to true in OpenAI's API, but an absent
  ``store`` is treated as false: refusing every default request would help no one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from engine.contract.errors import invalid_param, unsupported_param

LOGPROBS_INCLUDE = "message.output_text.logprobs"
PASSED_THROUGH = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "seed",
                  "cache_salt", "top_k", "stop", "top_logprobs")


def to_chat_body(body: object) -> dict[str, Any]:
    """The chat request equivalent to a Responses request (see the module docstring)."""
    return translate(body)[0]


def translate(body: object) -> tuple[dict[str, Any], list[str]]:
    """:func:`to_chat_body`, and for each chat message the Responses param it came from
    (``"instructions"``, ``"input"`` or ``"input[i]"``), for :func:`responses_param`."""
    if not isinstance(body, dict):
        raise invalid_param("The request body must be a JSON object.", None, "invalid_json")
    if body.get("store") is True:
        raise unsupported_param("store: true is not supported: this engine keeps no responses. "
                                "Send store: false and the whole conversation as 'input'.", "store")
    if body.get("previous_response_id") is not None:
        raise unsupported_param("previous_response_id is not supported: this engine keeps no "
                                "responses. Send the whole conversation as 'input'.",
                                "previous_response_id")
    if body.get("background") is True:
        raise unsupported_param("background responses are not supported.", "background")
    chat: dict[str, Any] = {k: body[k] for k in PASSED_THROUGH if body.get(k) is not None}
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid_param("'instructions' must be a string.", "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
        origins.append("instructions")
    messages.extend(_input_messages(body.get("input"), origins))
    chat["messages"] = messages
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid_param("'text' must be an object.", "text", "invalid_type")
        if text.get("format") is not None:
            chat["response_format"] = _format(text["format"])
    include = body.get("include")
    if body.get("top_logprobs") is not None or (
            isinstance(include, list) and LOGPROBS_INCLUDE in include):
        chat["logprobs"] = True
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    return chat, origins


RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def responses_param(param: str | None, origins: Sequence[str] = ()) -> str | None:
    """The Responses API's name for a chat ``param`` named in an error (the chat request
    came from :func:`translate`). ``messages[k]...`` becomes the input item message ``k``
    came from (its ``origins[k]``) with the rest of the path, content part indexes being
    kept one to one; without origins, plain ``input``. ``tools[i].function.x`` is
    ``tools[i].x`` (Responses tools are flat)."""
    match = _MESSAGE_PARAM.match(param or "")
    if match is not None and int(match[1]) < len(origins):
        origin = origins[int(match[1])]
        return origin + match[2] if origin.startswith("input[") else origin
    tool = _TOOL_PARAM.match(param or "")
    if tool is not None:  # Responses tools are flat: tools[i].parameters
        return f"tools[{tool[1]}]{tool[2]}"
    for chat, responses in RENAMED:
        if param is not None and param.startswith(chat):
            return "input" if chat == "messages" else responses + param[len(chat):]
    return param


_MESSAGE_PARAM = re.compile(r"messages\[(\d+)\](.*)", re.DOTALL)
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)", re.DOTALL)
IMAGE_DETAILS = ("auto", "low", "high")


def _input_messages(value: object, origins: list[str]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        origins.append("input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid_param("'input' must be a string or a non-empty array of input items.", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_param(f"{param} must be an object.", param, "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), param)})
            origins.append(param)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise invalid_param(f"{param} needs 'name' and 'call_id' strings.", param)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(param)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise invalid_param(f"{param} needs 'call_id' and 'output' strings.", param)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            origins.append(param)
        else:
            raise unsupported_param(f"{param}.type {kind!r} is not supported; use message, "
                                    "function_call or function_call_output.", f"{param}.type")
    return messages


def _content(content: object, param: str) -> object:
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise invalid_param(f"{param}.content[{j}].text must be a string.",
                                    f"{param}.content[{j}].text", "invalid_type")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append(_image_part(part, f"{param}.content[{j}]"))
        else:
            raise unsupported_param(f"{param}.content[{j}] of type {kind!r} is not supported; "
                                    "only text and input_image parts are.", f"{param}.content[{j}]")
    return parts


def _image_part(part: dict[str, Any], param: str) -> dict[str, Any]:
    """Chat's ``image_url`` part for an ``input_image`` (content part indexes stay one to one)."""
    if part.get("file_id") is not None:
        raise unsupported_param(f"{param}.file_id is not supported: this engine keeps no files. "
                                "Send the image as image_url (a data: URL).", f"{param}.file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise invalid_param(f"{param}.image_url must be a non-empty string (a URL or a data: URL).",
                            f"{param}.image_url", "invalid_type")
    spec: dict[str, Any] = {"url": url}
    detail = part.get("detail")
    if detail is not None:
        if detail not in IMAGE_DETAILS:
            raise invalid_param(f"{param}.detail must be one of {', '.join(IMAGE_DETAILS)}, "
                                f"got {detail!r}.", f"{param}.detail")
        spec["detail"] = detail
    return {"type": "image_url", "image_url": spec}


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid_param("'tools' must be an array of tools.", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise unsupported_param(f"tools[{i}] of type {kind!r} is not supported; only "
                                    "function tools are.", f"tools[{i}].type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(fmt: object) -> object:
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt
