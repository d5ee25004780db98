"""GenerationBody: an OpenAI request body, type- and range-checked, before tokenization.

:func:`parse_chat_body` and :func:`parse_completion_body` take the decoded JSON of
``POST /v1/chat/completions`` and ``POST /v1/completions`` and either return a
:class:`GenerationBody` or raise :class:`~engine.contract.errors.APIError` naming the bad
field in ``param``. Nothing here touches the tokenizer or the engine; the prompt
length checks happen in :meth:`GenerationBody.sampling_params` once the prompt is
tokenized.

Rules (each enforced in exactly one place below):

* JSON ``null`` means "not given" for every optional field, as in OpenAI's API;
* booleans are never accepted where a number is expected (``True`` is not ``1``);
* fields this engine does not implement are refused with ``code:
  "unsupported_parameter"`` when set to anything but their neutral value (zero
  penalties, no ``logit_bias``, ``echo=false``, ...), never silently ignored;
  unknown extra fields are ignored, as vLLM does;
* ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` are checked by
  :mod:`engine.server.tool_calls`, ``response_format`` by
  :mod:`engine.server.structured_output`;
* ``n`` is at most :data:`MAX_N`; chat ``top_logprobs`` needs ``logprobs: true``;
  completions' ``logprobs`` is the number of alternatives (0 to 20), and so is
  their ``prompt_logprobs`` (vLLM's: per prompt token, its logprob and alternatives);
* ``top_k`` of ``0`` or ``-1`` means "no limit" (vLLM's spelling) and becomes None;
* ``max_completion_tokens`` wins over the older ``max_tokens`` when both are set;
* JSON nested deeper than :data:`MAX_JSON_DEPTH` levels is refused (400
  ``json_too_deep``) before anything walks it recursively: the chat template, the
  tool renderer and JSON encoders would otherwise fail with a recursion error.
  :func:`engine.contract.limits.json_too_deep` is also the gateway's check, so both servers agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import KV_COMPRESSIONS
from engine.contract.errors import context_length_exceeded, invalid_param, unsupported_param
from engine.contract.limits import MAX_JSON_DEPTH, cache_salt_problem, too_deep_field
from engine.core.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from engine.server.structured_output import ResponseFormat, parse_response_format
from engine.server.tool_calls import ToolChoice, check_tools, parse_tool_choice

MAX_STOP_STRINGS = 16
MAX_N = 16
NO_TOOLS = ToolChoice("none")
COMPLETION_DEFAULT_MAX_TOKENS = 16
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class GenerationBody:
    """A validated chat or completion request; exactly one of messages/prompt is set."""

    kind: str  # "chat" | "completion"
    model: str | None
    stream: bool
    include_usage: bool
    cache_salt: str | None
    max_tokens: int | None  # None: chat fills the context, completions use 16
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's and k alternatives
    prompt_logprobs: int | None = None  # completions: each prompt token's logprob and k alternatives
    kv_compression: str | None = None  # "pyramid" | "none"; None: the engine's default
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = NO_TOOLS
    response_format: ResponseFormat | None = None
    prompt: str | list[int] | None = None

    def text_chars(self) -> int:
        """Characters of prompt text the body carries (message contents, text parts, a string
        prompt): a lower bound of what the tokenizer will see, counted without rendering."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        total = 0
        for message in self.messages or ():
            content = message.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(part["text"]) for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
        return total

    def sampling_params(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """Sampling parameters for a prompt of ``num_prompt_tokens``.

        Raises APIError ``context_length_exceeded`` when the prompt leaves no room
        for one generated token, or an explicit ``max_tokens`` does not fit.
        """
        param = "messages" if self.kind == "chat" else "prompt"
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_model_len} tokens, but the "
                f"prompt has {num_prompt_tokens} tokens, leaving no room for a completion.",
                param,
            )
        if self.max_tokens is None:
            max_tokens = room if self.kind == "chat" else min(room, COMPLETION_DEFAULT_MAX_TOKENS)
        elif self.max_tokens > room:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {num_prompt_tokens} tokens and {self.max_tokens} were requested for the "
                f"completion ({num_prompt_tokens + self.max_tokens} in total).",
                "max_tokens",
            )
        else:
            max_tokens = self.max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


def parse_chat_body(body: object, vocab_size: int) -> GenerationBody:
    """Validate a chat completion request body (the message structure is checked by chat.py)."""
    obj = _require_object(body)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_param("'messages' must be a non-empty array of message objects.", "messages")
    if not all(isinstance(m, dict) for m in messages):
        raise invalid_param("Every entry of 'messages' must be an object.", "messages")
    tools = obj.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise invalid_param("'tools' must be an array of tool objects.", "tools")
    check_tools(tools)
    tool_choice = parse_tool_choice(obj.get("tool_choice"), tools, obj.get("parallel_tool_calls"))
    want_logprobs = _opt_bool(obj, "logprobs") or False
    top = _opt_int(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and top > 0 and not want_logprobs:
        raise invalid_param("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    max_tokens = _opt_int(obj, "max_completion_tokens", 1, _INT64_MAX)
    legacy = _opt_int(obj, "max_tokens", 1, _INT64_MAX)
    return _common(obj, "chat", vocab_size, max_tokens if max_tokens is not None else legacy,
                   messages=messages, tools=tools or None, tool_choice=tool_choice,
                   response_format=parse_response_format(obj.get("response_format")),
                   logprobs=(top or 0) if want_logprobs else None)


def parse_completion_body(body: object, vocab_size: int) -> GenerationBody:
    """Validate a legacy completion request body; the prompt is a string or token ids."""
    obj = _require_object(body)
    prompt = _parse_prompt(obj.get("prompt"), vocab_size)
    logprobs = _opt_int(obj, "logprobs", 0, MAX_TOP_LOGPROBS)
    prompt_logprobs = _opt_int(obj, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    _refuse_unless(obj, "echo", (False,), "echo is not supported by this engine.")
    _refuse_unless(obj, "suffix", ("",), "suffix is not supported by this engine.")
    _refuse_unless(obj, "best_of", (1,), "best_of other than 1 is not supported by this engine.")
    max_tokens = _opt_int(obj, "max_tokens", 1, _INT64_MAX)
    return _common(obj, "completion", vocab_size, max_tokens, prompt=prompt, logprobs=logprobs,
                   prompt_logprobs=prompt_logprobs)


def _common(obj: dict[str, Any], kind: str, vocab_size: int, max_tokens: int | None,
            **inputs: Any) -> GenerationBody:
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid_param("'model' must be a string.", "model")
    n = _opt_int(obj, "n", 1, MAX_N)
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        value = _opt_number(obj, name, -2.0 if neutral == 0.0 else 0.0, 2.0)
        if value is not None and value != neutral:
            raise unsupported_param(f"{name} is not supported by this engine (got {value}).", name)
    _refuse_unless(obj, "logit_bias", ({},), "logit_bias is not supported by this engine.")
    _refuse_unless(obj, "min_tokens", (0,), "min_tokens is not supported by this engine.")
    stream = _opt_bool(obj, "stream") or False
    top_k = _opt_int(obj, "top_k", -1, _INT64_MAX)
    temperature = _opt_number(obj, "temperature", 0.0, 2.0)
    top_p = _opt_number(obj, "top_p", 0.0, 1.0)
    if top_p is not None and top_p == 0.0:
        raise invalid_param("'top_p' must be in (0, 1], got 0.", "top_p")
    return GenerationBody(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=_include_usage(obj, stream),
        cache_salt=_cache_salt(obj.get("cache_salt")),
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=None if top_k is None or top_k <= 0 else top_k,
        seed=_opt_int(obj, "seed", _INT64_MIN, _INT64_MAX),
        stop=_stop(obj.get("stop")),
        stop_token_ids=_stop_token_ids(obj.get("stop_token_ids"), vocab_size),
        ignore_eos=_opt_bool(obj, "ignore_eos") or False,
        kv_compression=_kv_compression(obj.get("kv_compression")),
        n=n or 1,
        **inputs,
    )


def _require_object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid_param("The request body must be a JSON object.", None, "invalid_json")
    field = too_deep_field(body)
    if field is not None:
        raise invalid_param(f"'{field}' is nested more than {MAX_JSON_DEPTH} levels deep.", field,
                            "json_too_deep")
    return body


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _opt_number(obj: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_param(f"'{name}' must be a number, got {_type_name(value)}.", name, "invalid_type")
    if not lo <= value <= hi:
        raise invalid_param(f"'{name}' must be between {lo} and {hi}, got {value}.", name)
    return float(value)


def _opt_int(obj: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = obj.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_param(f"'{name}' must be an integer, got {_type_name(value)}.", name, "invalid_type")
    if not lo <= value <= hi:
        bound = f">= {lo}" if hi == _INT64_MAX else f"between {lo} and {hi}"
        raise invalid_param(f"'{name}' must be {bound}, got {value}.", name)
    return value


def _opt_bool(obj: dict[str, Any], name: str) -> bool | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise invalid_param(f"'{name}' must be a boolean, got {_type_name(value)}.", name, "invalid_type")
    return value


def _refuse_unless(obj: dict[str, Any], name: str, neutral: tuple[object, ...], message: str) -> None:
    value = obj.get(name)
    if value is None or any(value == n and type(value) is type(n) for n in neutral):
        return
    raise unsupported_param(message, name)


def _include_usage(obj: dict[str, Any], stream: bool) -> bool:
    options = obj.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid_param("'stream_options' must be an object.", "stream_options", "invalid_type")
    if not stream:
        raise invalid_param("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    return _opt_bool(options, "include_usage") or False


def _kv_compression(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value in KV_COMPRESSIONS):
        return value
    raise invalid_param(f"'kv_compression' must be one of {list(KV_COMPRESSIONS)}, got {value!r}.",
                        "kv_compression")


def _cache_salt(value: object) -> str | None:
    if value is None:
        return None
    problem = cache_salt_problem(value)
    if problem is not None:
        raise invalid_param(problem, "cache_salt")
    assert isinstance(value, str)
    return value


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in stops)):
        raise invalid_param(
            f"'stop' must be a non-empty string or an array of at most {MAX_STOP_STRINGS} "
            "non-empty strings.",
            "stop",
        )
    return tuple(stops)


def _token_ids(value: object, vocab_size: int) -> list[int] | None:
    """The list as token ids if every entry is an int in [0, vocab_size), else None."""
    if not isinstance(value, list):
        return None
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab_size:
            return None
    return value


def _stop_token_ids(value: object, vocab_size: int) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = _token_ids(value, vocab_size)
    if ids is None:
        raise invalid_param(
            f"'stop_token_ids' must be an array of token ids in [0, {vocab_size}).", "stop_token_ids"
        )
    return tuple(ids)


def _parse_prompt(value: object, vocab_size: int) -> str | list[int]:
    """A string or token ids; a batch of exactly one (``["..."]``, ``[[ids]]``) is unwrapped."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        raise unsupported_param("Batched prompts are not supported: send one prompt per request.",
                                "prompt")
    ids = _token_ids(value, vocab_size)
    if ids:
        return ids
    raise invalid_param(
        f"'prompt' must be a non-empty string or a non-empty array of token ids in [0, {vocab_size}).",
        "prompt",
    )
