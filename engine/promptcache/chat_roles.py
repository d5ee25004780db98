"""RoleTemplate: the text a model's chat template puts around each role's message.

PML's ``<system>``, ``<user>`` and ``<assistant>`` tags compile to the model's own
chat template, not to a fixed format. The template is a program (Jinja), so the
glue is found by running it: a four-message conversation (system, user, assistant,
user) is rendered with marker strings as contents, and the text between markers is
split into each role's prefix and suffix using renders that end with a user or an
assistant message. The result is then checked: the pieces must rebuild the
template's render exactly, or the template is not *compositional* (for example one
that moves the system text into the first user turn) and role tags are refused.

A leading BOS that the template writes is left out of the system prefix when the
tokenizer adds it by itself: the compiler adds the tokenizer's own leading special
tokens once, at the start of a prompt, as the completions path does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
_MARKS = ("\u27e6pml-0\u27e7", "\u27e6pml-1\u27e7", "\u27e6pml-2\u27e7", "\u27e6pml-3\u27e7")


@dataclass(frozen=True)
class RoleTemplate:
    """``prefix[role] + content + suffix[role]`` is one message as the template renders it;
    ``generation`` is what ``add_generation_prompt`` appends after a user message."""

    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str

    def wrap(self, role: str, content: str) -> str:
        return self.prefix[role] + content + self.suffix[role]


def _render(tokenizer: Any, roles: tuple[str, ...], generation: bool) -> str:
    conversation = [{"role": role, "content": mark} for role, mark in zip(roles, _MARKS, strict=False)]
    return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation))


def _after(text: str, mark: str) -> str:
    return text[text.index(mark) + len(mark):]


def _strip_start(text: str, start: str, what: str) -> str:
    if not text.startswith(start):
        raise ValueError(f"the chat template is not compositional ({what})")
    return text[len(start):]


def role_template(tokenizer: Any, start: str = "") -> RoleTemplate:
    """The role glue of ``tokenizer``'s chat template; ValueError saying why when the
    template cannot be split (no template, it rejects a role, or it is not compositional).
    ``start``: the text of the special tokens the tokenizer adds itself (a BOS), left
    out of the system prefix when the template writes it first."""
    s, u, a = ROLES
    try:
        full = _render(tokenizer, (s, u, a, u), False)
        ends_user = _render(tokenizer, (s, u), False)
        ends_assistant = _render(tokenizer, (s, u, a), False)
        with_generation = _render(tokenizer, (s, u), True)
    except Exception as exc:  # no template, jinja errors, raise_exception(...) in the template
        raise ValueError(f"the chat template cannot render a system/user/assistant conversation: {exc}") from None
    if any(full.count(m) != 1 for m in _MARKS):
        raise ValueError("the chat template does not render each message's content once")
    cuts = [full.index(m) for m in _MARKS]
    t0 = full[:cuts[0]]
    between = [full[cuts[i] + len(_MARKS[i]):cuts[i + 1]] for i in range(3)]
    suffix_user = _after(full, _MARKS[3])
    if _after(ends_user, _MARKS[1]) != suffix_user:
        raise ValueError("the chat template is not compositional (user suffix)")
    suffix_assistant = _after(ends_assistant, _MARKS[2])
    prefix_user = _strip_start(between[2], suffix_assistant, "assistant suffix")
    prefix_assistant = _strip_start(between[1], suffix_user, "assistant prefix")
    if not between[0].endswith(prefix_user):
        raise ValueError("the chat template is not compositional (system suffix)")
    suffix_system = between[0][:len(between[0]) - len(prefix_user)]
    start = start if start and t0.startswith(start) else ""
    prefix_system = t0[len(start):]
    generation = _strip_start(_after(with_generation, _MARKS[1]), suffix_user, "generation prompt")
    out = RoleTemplate({s: prefix_system, u: prefix_user, a: prefix_assistant},
                       {s: suffix_system, u: suffix_user, a: suffix_assistant}, generation)
    rebuilt = start + "".join(out.wrap(role, mark) for role, mark in zip((s, u, a, u), _MARKS, strict=True))
    if rebuilt != full:
        raise ValueError("the chat template is not compositional (its render cannot be rebuilt)")
    return out
