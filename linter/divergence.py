"""Where a later request stops extending an earlier one's prefix, and why (the PS2xx rules).

:func:`compare` renders both bodies (:mod:`linter.render`), finds the first
character where ``current`` stops repeating the part of ``previous`` it should
repeat, and names the cause at that point, in this order:

0. an image part spans the point on either side (another image, or an image
   added or removed) -> PS207;
1. a volatile value spans the point -> PS201;
2. the tools differ (order or set -> PS202; same data, other key order -> PS203);
3. ``tool_choice`` or ``response_format`` differ (key order only -> PS203, else PS205);
4. a system/developer message differs -> PS206;
5. a tool call's arguments differ only in key order or spacing -> PS203;
6. otherwise the history was edited or truncated instead of appended -> PS204.

Messages name a whitespace-only change (tools, instructions) and tool results
that were only reordered, the causes the opt-in rules PS106 and PS105 check in
single requests. A divergence that costs no full block of the earlier prompt
(inside its last partial block) is not reported: nothing reusable was lost.

What should be repeated: for a later turn of the same conversation (as
:mod:`linter.conversation` defines it) everything up to the end of
``previous``'s last message; for
another request of the same family, the tools, ``tool_choice``,
``response_format`` and leading system/developer messages.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.contract.limits import BLOCK_SIZE
from linter import chat_request
from linter.canonical_json import canonical_text, parse_json, sort_keys, tool_names
from linter.conversation import conversation_keys
from linter.render import Rendered, Segment, image_name, render
from linter.tokenizer import ApproxTokenizer, Tokenizer
from linter.volatile import find_volatile

DEFAULT_BLOCK_SIZE = BLOCK_SIZE
_MESSAGE_INDEX = re.compile(r"^messages\[(\d+)\]")
_TOOL_INDEX = re.compile(r"^tools\[(\d+)\]")
_default_tokenizer = ApproxTokenizer(memo_limit=4096)  # long-lived in the gateway: keep it small

T = TypeVar("T", str, list[int])


@dataclass(frozen=True)
class Divergence:
    code: str
    message: str
    location: str
    offset: int
    tokens_lost: int
    needle: str | None = None


def common_prefix_len(a: T, b: T) -> int:
    """Length of the longest common prefix of two strings or two token lists.

    Compares in chunks (C-speed slice equality), then bisects inside the first
    differing chunk: linear in the shared length.
    """
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    chunk = 1024
    lo = 0
    while lo + chunk <= limit and a[lo : lo + chunk] == b[lo : lo + chunk]:
        lo += chunk
    base, hi = lo, min(lo + chunk, limit)
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[base:mid] == b[base:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def is_same_conversation(previous: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """Whether ``current`` continues ``previous``'s conversation (:mod:`linter.conversation`)."""
    a, b = conversation_keys(previous), conversation_keys(current)
    if a is None or b is None:
        return False
    if a.explicit or b.explicit:
        return a.explicit and b.explicit and a.remember == b.remember
    return any(key in b.lookup for key in (a.remember, *a.also))


def _encode(rendered: Rendered, end: int, tokenizer: Tokenizer) -> list[int]:
    """Tokens of ``rendered.text[:end]``; ``end`` must be a segment boundary for the fast path."""
    if isinstance(tokenizer, ApproxTokenizer):
        count = rendered.parts_before(end)
        if count is not None:
            return tokenizer.encode_parts(rendered.parts[:count])
    return tokenizer.encode(rendered.text[:end])


def tokens_lost(previous: Rendered, expected_end: int, current: Rendered, tokenizer: Tokenizer, block_size: int) -> int:
    """Tokens of the full blocks of ``previous.text[:expected_end]`` that ``current`` no longer shares."""
    a = _encode(previous, expected_end, tokenizer)
    b = _encode(current, len(current.text), tokenizer)
    shared = common_prefix_len(a, b)
    return max(0, (len(a) // block_size - shared // block_size) * block_size)


def _volatile_cause(r: Rendered, seg: Segment | None, offset: int) -> str | None:
    if seg is None:
        return None
    for span in find_volatile(r.text[seg.start : seg.end]):
        if seg.start + span.start <= offset < seg.start + span.end:
            return f"{span.kind} {span.value!r}"
    return None


def _tools_cause(previous: Mapping[str, Any], current: Mapping[str, Any], location: str) -> tuple[str, str]:
    before, after = tool_names(previous), tool_names(current)
    if before != after and sorted(before) == sorted(after):
        return "PS202", f"tool order changed from {before} to {after}"
    if set(before) != set(after):
        added, removed = sorted(set(after) - set(before)), sorted(set(before) - set(after))
        return "PS202", f"tool set changed (added {added}, removed {removed})"
    match = _TOOL_INDEX.match(location)
    raw_a, raw_b = previous.get("tools"), current.get("tools")
    if match is not None and isinstance(raw_a, list) and isinstance(raw_b, list):
        i = int(match.group(1))
        if i < len(raw_a) and i < len(raw_b):
            if sort_keys(raw_a[i]) == sort_keys(raw_b[i]):
                return "PS203", f"tools[{i}] has the same content but a different JSON key order"
            name = chat_request.tool_name(raw_a[i]) if isinstance(raw_a[i], (dict, Mapping)) else ""
            if _whitespace_only(raw_a[i], raw_b[i]):
                return "PS202", f"definition of tool {name or i!r} changed only in whitespace (normalize it, see PS106)"
            return "PS202", f"definition of tool {name or i!r} changed"
    return "PS202", "tool definitions changed"


def _message(body: Mapping[str, Any], index: int) -> Mapping[str, Any] | None:
    raw = body.get("messages")
    if isinstance(raw, list) and index < len(raw) and isinstance(raw[index], (dict, Mapping)):
        message: Mapping[str, Any] = raw[index]
        return message
    return None


def _history_cause(previous: Mapping[str, Any], current: Mapping[str, Any], index: int, seg: Segment) -> tuple[str, str]:
    before = _message(previous, index)
    after = _message(current, index)
    if before is not None and chat_request.role(before) in chat_request.STATIC_ROLES:
        if after is not None and _whitespace_only(chat_request.content_text(before), chat_request.content_text(after)):
            return "PS206", f"system/developer message messages[{index}] changed only in whitespace (normalize it, see PS106)"
        return "PS206", f"system/developer message messages[{index}] changed"
    if seg.kind == "tool_call" and before is not None and after is not None:
        calls_a, calls_b = chat_request.tool_calls(before), chat_request.tool_calls(after)
        if len(calls_a) == len(calls_b) and [_args(c) for c in calls_a] == [_args(c) for c in calls_b]:
            return "PS203", f"tool-call arguments in messages[{index}] were re-serialized (key order or spacing)"
    prev_msgs = previous.get("messages") if isinstance(previous.get("messages"), list) else []
    cur_msgs = current.get("messages") if isinstance(current.get("messages"), list) else []
    assert isinstance(prev_msgs, list) and isinstance(cur_msgs, list)
    if index >= len(cur_msgs):
        return "PS204", f"history truncated: the earlier request had messages[{index}], this one stops before it"
    if isinstance(cur_msgs[index], Mapping) and cur_msgs[index].get("role") == "tool":
        run_a, run_b = _tool_run(prev_msgs, index), _tool_run(cur_msgs, index)
        if run_a != run_b and sorted(map(canonical_text, run_a)) == sorted(map(canonical_text, run_b)):
            return "PS204", f"tool results reordered at messages[{index}] (append them in tool_calls order, see PS105)"
    later = prev_msgs[index + 1 :]
    if later and cur_msgs[index] in later:
        dropped = later.index(cur_msgs[index]) + 1
        return "PS204", f"history truncated in the middle: {dropped} earlier message(s) dropped at messages[{index}]"
    return "PS204", f"history edited: messages[{index}] differs from the earlier request instead of being appended to"


def _whitespace_only(a: Any, b: Any) -> bool:
    """Whether two texts (or JSON values) differ only in whitespace inside strings."""

    def squash(value: Any) -> Any:
        if isinstance(value, str):
            return " ".join(value.split())
        if isinstance(value, Mapping):
            return {k: squash(v) for k, v in value.items()}
        if isinstance(value, list):
            return [squash(v) for v in value]
        return value

    return a != b and squash(a) == squash(b)


def _tool_run(messages: list[Any], index: int) -> list[Any]:
    """The consecutive tool messages around ``index`` (the results of one parallel call)."""
    start = index
    while start > 0 and isinstance(messages[start - 1], Mapping) and messages[start - 1].get("role") == "tool":
        start -= 1
    end = index
    while end < len(messages) and isinstance(messages[end], Mapping) and messages[end].get("role") == "tool":
        end += 1
    return messages[start:end]


def _args(call: Mapping[str, Any]) -> Any:
    function = call.get("function")
    args = function.get("arguments") if isinstance(function, (dict, Mapping)) else None
    if isinstance(args, str):
        ok, value = parse_json(args)
        return canonical_text(value) if ok else args
    return args


def _image_segment(r: Rendered, seg: Segment | None) -> Segment | None:
    """``seg`` if it renders an image, or the image it separates from the previous part."""
    if seg is None or seg.kind == "image":
        return seg if seg is not None else None
    if seg.kind == "markup" and seg.end < len(r.text):
        following = r.segment_at(seg.end)
        if following is not None and following.kind == "image" and following.location == seg.location:
            return following
    return None


def _image_cause(pr: Rendered, cr: Rendered, seg_p: Segment, seg_c: Segment | None) -> tuple[str, Segment] | None:
    image_p, image_c = _image_segment(pr, seg_p), _image_segment(cr, seg_c)
    before = image_name(pr.text[image_p.start : image_p.end]) if image_p is not None else None
    after = image_name(cr.text[image_c.start : image_c.end]) if image_c is not None else None
    if image_p is not None and image_c is not None:
        hint = ""
        if str(before).startswith("url:") and str(after).startswith("url:"):
            hint = "; remote images are compared by URL, so a re-signed or versioned URL is another image"
        return f"image {image_c.location} changed (image {before} became {after}{hint})", image_c
    if image_p is not None:
        return f"image {image_p.location} (image {before}) was removed or replaced", image_p
    if image_c is not None:
        return f"image {image_c.location} (image {after}) was inserted where the earlier request had text", image_c
    return None


def _classify(previous: Mapping[str, Any], current: Mapping[str, Any], pr: Rendered, cr: Rendered, offset: int) -> tuple[str, str, Segment]:
    seg_p, seg_c = pr.segment_at(offset), cr.segment_at(offset)
    seg = seg_c or seg_p
    assert seg is not None and seg_p is not None
    image = _image_cause(pr, cr, seg_p, seg_c)
    if image is not None:
        return "PS207", image[0], image[1]
    volatile = _volatile_cause(pr, seg_p, offset) or _volatile_cause(cr, seg_c, offset)
    if volatile is not None:
        return "PS201", f"prefix diverges inside a volatile value: {volatile}", seg
    if seg_p.location.startswith("tools") or (seg_c and seg_c.location.startswith("tools")):
        code, why = _tools_cause(previous, current, seg_p.location)
        return code, why, seg
    for key in ("tool_choice", "response_format"):
        if seg_p.kind == key or (seg_c is not None and seg_c.kind == key):
            a, b = previous.get(key), current.get(key)
            if a is not None and b is not None and sort_keys(a) == sort_keys(b):
                return "PS203", f"{key} has the same content but a different JSON key order", seg
            return "PS205", f"{key} changed from {canonical_text(a)} to {canonical_text(b)}", seg
    match = _MESSAGE_INDEX.match(seg_p.location)
    index = int(match.group(1)) if match else 0
    code, why = _history_cause(previous, current, index, seg_p)
    return code, why, seg


def compare(
    previous: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    tokenizer: Tokenizer | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    rendered: Sequence[Rendered] | None = None,
    same_conversation: bool | None = None,
    edits: bool = True,
) -> Divergence | None:
    """The first divergence of ``current`` from ``previous`` (see the module docstring), or None.

    ``same_conversation`` None means: infer it with :func:`is_same_conversation`.
    ``edits`` False leaves out a history that only differs (PS204 "history
    edited"), for a conversation named by a shared ``prompt_cache_key``.
    """
    pr, cr = rendered if rendered is not None else (render(previous), render(current))
    if same_conversation is None:
        same_conversation = is_same_conversation(previous, current)
    expected_end = pr.history_end if same_conversation else pr.static_end
    if expected_end == 0:
        return None
    offset = common_prefix_len(pr.text[:expected_end], cr.text)
    if offset >= expected_end or offset >= cr.history_end:
        # Extends the earlier prompt, or is itself a prefix of it (a retry or a branch).
        return None
    code, why, seg = _classify(previous, current, pr, cr, offset)
    if not edits and offset >= pr.static_end and (code == "PS207" or why.startswith("history edited")):
        return None
    location = f"{seg.location}[{offset - seg.start}]" if seg.kind in ("message", "tool_call") else seg.location
    lost = tokens_lost(pr, expected_end, cr, tokenizer or _default_tokenizer, block_size)
    if lost == 0:
        return None  # inside the last partial block: nothing that could have been reused is lost
    scope = "conversation" if same_conversation else "request family"
    needle = cr.text[offset : min(seg.end, offset + 24)] if seg.kind == "message" else None
    message = f"{why}; the {scope}'s shared prefix breaks here"
    return Divergence(code, message, location, offset, lost, needle or None)
