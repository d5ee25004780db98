"""The Responses API (``POST /v1/responses``), stateless: request translation and output shapes.

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

:class:`ResponsesBuilder` builds the ``response`` object and the stream's events:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a function call
``response.function_call_arguments.delta`` and ``.done``, then
``response.output_item.done``; finally ``response.completed`` (or
``response.incomplete`` with ``incomplete_details.reason: "max_output_tokens"``),
or an ``error`` event when the request failed (the stream's last event). Every event
carries a ``sequence_number`` counting from 0. A stream holds the output items of
the non-streamed answer: one message item for the text, then one item per call.
``response.created`` and ``response.in_progress`` carry ``text.format`` without its
``schema``: the request's schema travels once, in the final ``response``.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from engine.core.output_stream import TokenLogprobs
from engine.server.errors import invalid_param, unsupported_param
from engine.server.response_builder import Usage

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


class ResponsesBuilder:
    """The ``response`` object and stream events of one Responses request."""

    def __init__(self, model: str, request: dict[str, Any],
                 token_text: Callable[[int], str] = str) -> None:
        self.model = model
        self.token_text = token_text
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.request = request
        self._seq = 0
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []
        self._message_open = False
        self._output: list[dict[str, Any]] = []

    # ------------------------------------------------------------------- body
    def full(self, text: str, calls: list[dict[str, Any]], finish_reason: str,
             usage: Usage, logprobs: list[TokenLogprobs] | None = None) -> dict[str, Any]:
        items = ([self._message_item(text, "completed", self._entries(logprobs))]
                 if text or not calls else [])
        items += [self._call_item(c) for c in calls]
        return self._response(_status(finish_reason), items, usage)

    # ----------------------------------------------------------------- events
    def start(self) -> list[bytes]:
        body = self._response("in_progress", [], None, echo_schema=False)
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def text(self, delta: str, logprobs: list[TokenLogprobs] | None = None) -> list[bytes]:
        """Events for a text delta (opening the message item first if needed)."""
        events = []
        if not self._message_open:
            self._message_open = True
            self._message_id = f"msg_{uuid.uuid4().hex}"
            item = self._message_item("", "in_progress")
            item["content"] = []
            events += [self._event("response.output_item.added", output_index=len(self._output),
                                   item=item),
                       self._event("response.content_part.added", item_id=self._message_id,
                                   output_index=len(self._output), content_index=0,
                                   part=_text_part(""))]
        self._text += delta
        entries = self._entries(logprobs)
        self._logprobs += entries
        events.append(self._event("response.output_text.delta", item_id=self._message_id,
                                  output_index=len(self._output), content_index=0, delta=delta,
                                  logprobs=entries))
        return events

    def calls(self, calls: list[dict[str, Any]]) -> list[bytes]:
        """Events for whole tool calls, each its own item after the message (if any)."""
        if not calls:
            return []
        events = self._close_message()
        for call in calls:
            item = self._call_item(call)
            index = len(self._output)
            args = call["function"]["arguments"]
            events += [
                self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=args),
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=args),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
            self._output.append(item)
        return events

    def finish(self, finish_reason: str, usage: Usage) -> list[bytes]:
        events = self._close_message()
        if not self._output:  # nothing generated at all: still one (empty) message
            events += self.text("") + self._close_message()
        status = _status(finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self._response(status, self._output, usage))]

    def error(self, error: dict[str, Any]) -> bytes:
        """The ``error`` event that ends a stream the engine failed."""
        return self._event("error", code=error.get("code"), message=error.get("message"),
                           param=error.get("param"))

    # ---------------------------------------------------------------- private
    def _close_message(self) -> list[bytes]:
        if not self._message_open:
            return []
        self._message_open = False
        index = len(self._output)
        item = self._message_item(self._text, "completed", self._logprobs)
        events = [
            self._event("response.output_text.done", item_id=self._message_id, output_index=index,
                        content_index=0, text=self._text, logprobs=self._logprobs),
            self._event("response.content_part.done", item_id=self._message_id, output_index=index,
                        content_index=0, part=_text_part(self._text, self._logprobs)),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self._output.append(item)
        self._text = ""
        self._logprobs = []
        return events

    def _message_item(self, text: str, status: str,
                      logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if not hasattr(self, "_message_id"):
            self._message_id = f"msg_{uuid.uuid4().hex}"
        return {"id": self._message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(text, logprobs or [])]}

    def _entries(self, logprobs: list[TokenLogprobs] | None) -> list[dict[str, Any]]:
        """OpenAI's Responses logprobs entries: token, logprob, bytes, top_logprobs."""
        return [{**self._token(e.token_id, e.logprob),
                 "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                for e in logprobs or ()]

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    @staticmethod
    def _call_item(call: dict[str, Any]) -> dict[str, Any]:
        return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed",
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"]}

    def _response(self, status: str, output: list[dict[str, Any]], usage: Usage | None,
                  echo_schema: bool = True) -> dict[str, Any]:
        req = self.request
        text_format = (req.get("text") or {}).get("format") or {"type": "text"}
        if not echo_schema and isinstance(text_format, dict):
            text_format = {k: v for k, v in text_format.items() if k != "schema"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
            "model": self.model, "output": list(output), "parallel_tool_calls":
                req.get("parallel_tool_calls") is not False,
            "previous_response_id": None, "store": False,
            "temperature": req.get("temperature", 1.0), "top_p": req.get("top_p", 1.0),
            "text": {"format": text_format}, "tool_choice": req.get("tool_choice", "auto"),
            "tools": req.get("tools") or [], "truncation": "disabled", "metadata": {},
            "usage": None if usage is None else _usage(usage),
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
