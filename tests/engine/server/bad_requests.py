"""A seeded generator of malformed (and some well-formed) OpenAI requests, for fuzzing.

Shared by the fuzz test (a few hundred cases per run) and
``benchmarks/fault_campaign.py`` (thousands). :func:`cases` yields
:class:`Case` objects: the endpoint path, the raw body bytes (so invalid JSON,
non-UTF-8 and nesting no encoder accepts can be sent) and the kind of mistake,
for the campaign's table. Every case is a pure function of ``(seed, index)``.

:func:`check_answer` states what any answer to any of them must satisfy: a status
below 500 and, for a 4xx, OpenAI's error shape; a 200 is valid JSON (or an SSE
stream of JSON events ending in ``[DONE]`` with no error event).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from support.sse import sse_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Values of every JSON type and a few extremes, for "wrong type" and "numeric extreme" cases.
ODD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, -(2**63) + 1, 0.5, -0.0,
    1e-45, 1e-300, 5e-324, 1e308, -1e308, 3.4e38, "", "x", "1", "true", "\u0000", "\ud7ff\ue000", [],
    [1], ["a"], [[]], {}, {"a": 1}, {"type": "text"},
]
RAW_NUMBERS = [b"1e400", b"-1e400", b"1e-400", b"18446744073709551616", b"-9223372036854775809",
               b"123456789012345678901234567890", b"0.0000000000000000000000001", b"-0", b"1E+2"]
FIELDS = [
    "model", "messages", "prompt", "stream", "stream_options", "temperature", "top_p", "top_k",
    "max_tokens", "max_completion_tokens", "seed", "stop", "stop_token_ids", "n", "logprobs",
    "top_logprobs", "tools", "tool_choice", "response_format", "cache_salt", "user", "metadata",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
    "min_tokens", "best_of", "echo", "suffix", "parallel_tool_calls",
]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id"]
ROLES = ["system", "developer", "user", "assistant", "tool", "robot", "", "USER"]


@dataclass(frozen=True)
class Case:
    index: int
    kind: str  # what is wrong with it (the campaign's rows)
    path: str
    body: bytes


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]", leaf: bytes = b"1") -> bytes:
    return opener * depth + leaf + closer * depth


def nested_object(depth: int) -> bytes:
    return b'{"a": ' * depth + b"1" + b"}" * depth


class _Generator:
    def __init__(self, rng: random.Random, model: str) -> None:
        self.rng = rng
        self.model = model

    # ----------------------------------------------------------- valid parts
    def text(self) -> str:
        pool = ["hi", "Hello there", "2024-01-01 12:00:00", "é✓漢字🙂", "a\nb\tc", "{\"json\": 1}",
                "<|im_start|>", "<|im_end|>", "\\u0000", " " * 40]
        return self.rng.choice(pool)

    def message(self) -> dict[str, Any]:
        return {"role": self.rng.choice(["system", "user", "assistant"]), "content": self.text()}

    def valid_body(self, path: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.rng.randint(1, 2)}
        if path == CHAT:
            body["messages"] = [*(self.message() for _ in range(self.rng.randint(0, 2))),
                                {"role": "user", "content": self.text()}]
        else:
            body["prompt"] = self.text()
        if self.rng.random() < 0.3:
            body["stream"] = True
            if self.rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        if self.rng.random() < 0.3:
            body["temperature"] = self.rng.choice([0, 0.7, 1e-45, 1e-300, 5e-324, 2])
        return body

    # ----------------------------------------------------------- mistakes
    def case(self, index: int) -> Case:
        path = self.rng.choice([CHAT, CHAT, COMPLETIONS])
        kind = self.rng.choice([
            "valid", "wrong_type", "wrong_type", "numeric_extreme", "message_shape", "message_shape",
            "content_parts", "tools_shape", "nesting", "nesting", "invalid_json", "non_utf8", "not_object",
            "size", "unknown_fields", "token_ids",
        ])
        body = self.valid_body(path)
        raw: bytes | None = None
        if kind == "wrong_type":
            touched = [self.rng.choice(FIELDS) for _ in range(self.rng.randint(1, 3))]
            for field in touched:
                body[field] = self.rng.choice(ODD_VALUES)
            # Keep generation short when a length field got an odd (but valid) value:
            # max_completion_tokens wins over max_tokens when set.
            if "max_completion_tokens" in touched and "max_tokens" not in touched:
                body["max_tokens"] = 2
            elif "max_tokens" in touched and "max_completion_tokens" not in touched:
                body["max_completion_tokens"] = 2
        elif kind == "numeric_extreme":
            field = self.rng.choice(["temperature", "top_p", "top_k", "max_tokens", "seed", "n",
                                     "presence_penalty", "max_completion_tokens", "top_logprobs"])
            raw = self._with_raw_field(body, field, self.rng.choice(RAW_NUMBERS))
        elif kind == "message_shape" and path == CHAT:
            message: dict[str, Any] = {"role": self.rng.choice(ROLES), "content": self.text()}
            for _ in range(self.rng.randint(1, 3)):
                message[self.rng.choice(MESSAGE_FIELDS)] = self.rng.choice(ODD_VALUES)
            body["messages"] = self.rng.choice([[message], [*body["messages"], message], [message] * 3])
        elif kind == "content_parts" and path == CHAT:
            parts = [self.rng.choice([
                {"type": "text", "text": self.text()}, {"type": "text"}, {"type": "text", "text": 5},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {"type": "image_url", "image_url": "http://127.0.0.1:9/x.png"}, {"type": "audio"},
                {"type": None}, "text", 7, [], {},
            ]) for _ in range(self.rng.randint(0, 4))]
            body["messages"] = [{"role": "user", "content": parts}]
        elif kind == "tools_shape":
            tool = self.rng.choice([
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": 3}}, {"type": "function"}, {"function": []},
                {"type": "function", "function": {"name": "f", "parameters": "not a schema"}}, "tool", 1,
            ])
            body["tools"] = self.rng.choice([[tool], [tool, tool], tool, {}, "tools"])
            if self.rng.random() < 0.5:
                body["tool_choice"] = self.rng.choice([*ODD_VALUES, "auto", "none", "required"])
            if path == CHAT and self.rng.random() < 0.5:
                body["messages"].append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": self.rng.choice(["c1", 1, None]), "type": "function",
                     "function": {"name": "f", "arguments": self.rng.choice(["{}", "{not json", 5, None,
                                                                               "[" * 600 + "]" * 600])}}]})
        elif kind == "nesting":
            depth = self.rng.choice([100, 127, 128, 129, 200, 253, 254, 255, 300, 600, 1000, 1023, 1100, 5000])
            where = self.rng.choice(["tools", "metadata", "content", "response_format", "stop"])
            inner = nested_object(depth) if self.rng.random() < 0.5 else nested(depth)
            if where == "tools":
                inner = (b'[{"type": "function", "function": {"name": "f", "parameters": ' + inner + b"}}]")
            elif where == "content" and path == CHAT:
                inner = b'[{"role": "user", "content": ' + inner + b"}]"
                where = "messages"
            raw = self._with_raw_field(body, where, inner)
        elif kind == "invalid_json":
            text = json.dumps(body).encode()
            cut = self.rng.randint(0, max(0, len(text) - 1))
            raw = self.rng.choice([text[:cut], text + b"}", text.replace(b":", b"=", 1), b"", b"nul",
                                   b"{'model': 'x'}", b"NaN", b'{"model": NaN}', b'{"a": Infinity}',
                                   b'{"a": "\\ud800"}', b'{"a": "\\x"}', b"\xef\xbb\xbf" + text])
        elif kind == "non_utf8":
            text = json.dumps(body, ensure_ascii=False).encode()
            at = self.rng.randint(0, len(text))
            raw = text[:at] + self.rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]) + text[at:]
        elif kind == "not_object":
            raw = self.rng.choice([b"[]", b"[1, 2]", b"1", b'"text"', b"null", b"true", b"[{}]"])
        elif kind == "size":
            size = self.rng.choice([10_000, 100_000, 1_000_000])
            filler = self.rng.choice(["x", "2024-01-01 ", "é", " "]) * (size // 4)
            if path == CHAT:
                body["messages"] = [{"role": "user", "content": filler}]
            else:
                body["prompt"] = filler
            if self.rng.random() < 0.3:
                body["stop"] = [filler[:100]] * self.rng.choice([1, 16, 17])
        elif kind == "unknown_fields":
            for i in range(self.rng.randint(1, 50)):
                body[f"x_{i}_{self.rng.random()}"] = self.rng.choice(ODD_VALUES)
        elif kind == "token_ids":
            path = COMPLETIONS
            body.pop("messages", None)
            body["prompt"] = self.rng.choice([[], [1, 2], [-1], [10**9], [1.5], [[1, 2]], [[1], [2]], [True],
                                              ["a", "b"], [2**63], list(range(3000))])
        return Case(index, kind, path, raw if raw is not None else json.dumps(body).encode())

    def _with_raw_field(self, body: dict[str, Any], field: str, raw_value: bytes) -> bytes:
        body = {k: v for k, v in body.items() if k != field}
        text = json.dumps(body).encode()
        return text[:-1] + b', "' + field.encode() + b'": ' + raw_value + b"}"


def cases(seed: int, count: int, model: str) -> Iterator[Case]:
    """``count`` cases; case ``i`` depends only on ``(seed, i)``."""
    for index in range(count):
        yield _Generator(random.Random(f"{seed}:{index}"), model).case(index)


def check_answer(status: int, content: bytes, stream_requested: bool | None = None) -> str | None:
    """None when the answer is acceptable for any request; else what is wrong with it."""
    if status >= 500:
        return f"status {status}: {content[:300]!r}"
    if status >= 400:
        try:
            body = json.loads(content)
        except ValueError:
            return f"{status} with a body that is not JSON: {content[:200]!r}"
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
            return f"{status} without OpenAI's error shape: {content[:300]!r}"
        if not isinstance(error["message"], str) or not error["message"]:
            return f"{status} with an empty message"
        return None
    if status != 200:
        return f"unexpected status {status}"
    if content.startswith(b"data:") or b"\n\ndata:" in content:
        events = sse_events(content)
        if not events or events[-1].strip() != b"data: [DONE]":
            return f"stream without a final [DONE]: {content[-200:]!r}"
        for event in events[:-1]:
            try:
                chunk = json.loads(event[len(b"data:"):])
            except ValueError:
                return f"stream event that is not JSON: {event[:200]!r}"
            if isinstance(chunk, dict) and "error" in chunk:
                return f"error event in a 200 stream: {event[:300]!r}"
        return None
    try:
        json.loads(content)
    except ValueError:
        return f"200 with a body that is not JSON: {content[:200]!r}"
    return None
