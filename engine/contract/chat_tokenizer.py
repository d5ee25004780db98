"""ChatTokenizer: a model's tokenizer and chat template without torch or transformers.

The gateway must produce exactly the token ids the engine will compute, so that
its block keys name the blocks the engine will hit. The engine renders chat
requests with :class:`engine.contract.chat.ChatRenderer` over a ``transformers`` tokenizer;
the gateway uses the same renderer (one implementation of message normalization,
content-part joins and inlined tools) over this class, which reproduces the two
``transformers`` calls the renderer makes:

* ``apply_chat_template(conversation, tools=..., add_generation_prompt=True,
  tokenize=False)``: the template is compiled in a jinja2
  ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML
  (``json.dumps`` with ``ensure_ascii=False``), ``raise_exception`` and
  ``strftime_now`` globals; keys whose value is ``None`` are dropped from every
  message, and the special tokens of ``tokenizer_config.json`` (``bos_token``,
  ``eos_token``, ...) are template variables, as in transformers 5.x;
* ``encode(text, add_special_tokens=...)``: the ``tokenizers`` library on the same
  ``tokenizer.json``.

The template comes from ``chat_template.jinja`` when the model directory has one,
else from ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
named templates: ``tool_use`` when tools are given and it exists, else
``default``). ``tests/gateway/test_gw_chat_tokenizer.py`` checks token-for-token
equality with the engine's renderer over many requests.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``*_token`` entries of tokenizer_config.json as strings (an AddedToken dict gives its content)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if not key.endswith("_token"):
            continue
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            value = value["content"]
        if isinstance(value, str):
            out[key] = value
    return out


def load_tokenizer_file(path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a Hugging Face ``tokenizer.json``: the one loader of
    the gateway's :class:`ChatTokenizer` and the linter's exact token counts.
    ValueError naming the file when it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception on bad files
        raise ValueError(f"cannot load tokenizer {str(path)!r}: {exc}") from None


class ChatTokenizer:
    """The tokenizer-like object :class:`engine.contract.chat.ChatRenderer` needs; thread-safe."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"no tokenizer.json in {str(model_dir)!r}")
        self._tokenizer = load_tokenizer_file(tokenizer_file)
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        template_file = model_dir / "chat_template.jinja"
        template: Any = template_file.read_text("utf-8") if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):
            template = {str(t.get("name")): str(t.get("template")) for t in template if isinstance(t, dict)}
        if not template:
            raise ValueError(f"no chat template in {str(model_dir)!r}")
        self.chat_template: str | dict[str, str] = template
        self.special_tokens = _special_tokens(config)
        env = _environment()
        if isinstance(template, dict):
            self._templates = {name: env.from_string(source) for name, source in template.items()}
        else:
            self._templates = {"default": env.from_string(template)}
        self._lock = threading.Lock()
        self.model_dir = model_dir

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = False) -> str:
        """The rendered prompt text, as ``transformers``' ``apply_chat_template(tokenize=False)``."""
        if tokenize:
            raise ValueError("ChatTokenizer renders text only (tokenize=False)")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation.")
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        template = self._templates.get(name) or next(iter(self._templates.values()))
        messages = [{k: v for k, v in m.items() if v is not None} for m in json.loads(json.dumps(conversation))]
        return template.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **self.special_tokens)

    def special_added_tokens(self) -> list[str]:
        """The texts of the tokenizer's special added tokens (each encodes to one id, never
        merged with its neighbours), highest id first."""
        decoder = self._tokenizer.get_added_tokens_decoder()
        return [token.content for _, token in sorted(decoder.items(), reverse=True) if token.special]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
