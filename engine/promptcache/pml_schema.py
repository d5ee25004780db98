"""CompiledSchema: a PML ``<schema>`` turned into modules of token ids.

A schema declares prompt modules; a prompt (:mod:`engine.promptcache.pml_prompt`)
imports some of them. Compiling a schema tokenizes every module's text once, so a
prompt only tokenizes its own text and its arguments.

Syntax (elements; text is kept verbatim, entities replaced)::

    <schema name="docs">
      <system>You answer from the documents.</system>      anonymous: in every prompt
      <module name="intro">Dear <param name="who" len="8"/>, here is ...</module>
      <union>                                               one member per prompt
        <module name="doc-en">...</module>
        <module name="doc-fr">...</module>
      </union>
      <module name="book">Chapters: <module name="ch1">...</module></module>   nested
    </schema>

Rules, each a :class:`~engine.promptcache.pml_syntax.PmlError` at the offending element:

* the root is ``<schema name=...>``; top-level children are ``<module>``,
  ``<union>`` (of ``<module>`` only) and anonymous content (text and role tags
  without modules or params), which must come before the first module; whitespace
  between top-level elements is ignored;
* a module holds text, ``<param name len>`` (empty; ``1 <= len <=``
  ``max_param_tokens``), nested ``<module>``/``<union>`` and role tags; role tags
  do not nest in each other; names are unique among siblings (union members
  included) and never a PML tag name;
* at most ``max_modules`` modules and ``max_tokens`` module tokens in a schema.

Role tags become the model's own chat template glue
(:class:`~engine.promptcache.chat_roles.RoleTemplate`), part of the module's text.
Text next to glue is tokenized as one string, as a chat render would be; a param
splits a module's text into separately tokenized pieces.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.promptcache.chat_roles import ROLES, RoleTemplate
from engine.promptcache.pml_syntax import MAX_NAME_CHARS, Element, PmlError, Text

RESERVED = frozenset({"schema", "prompt", "module", "param", "union", *ROLES})
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
PREAMBLE = "@preamble"


@dataclass(frozen=True)
class TextPiece:
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ParamSlot:
    name: str
    max_tokens: int


@dataclass(frozen=True)
class Nested:
    module: ModuleDef


@dataclass(frozen=True)
class Choice:
    members: tuple[ModuleDef, ...]


Item = TextPiece | ParamSlot | Nested | Choice


@dataclass
class ModuleDef:
    """One module: ``path`` is its name within the schema (``outer/inner`` when nested);
    ``children`` its nested modules by name, union members included; ``union_of`` the
    index of the union each member belongs to; ``tokens`` its own text's tokens (not
    its nested modules', not its params')."""

    name: str
    path: str
    items: list[Item] = field(default_factory=list)
    children: dict[str, ModuleDef] = field(default_factory=dict)
    union_of: dict[str, int] = field(default_factory=dict)
    params: dict[str, ParamSlot] = field(default_factory=dict)
    tokens: int = 0


@dataclass
class CompiledSchema:
    """A schema's modules (the top level as a nameless root module) and its preamble."""

    name: str
    root: ModuleDef
    preamble: tuple[int, ...]
    total_tokens: int

    def modules(self) -> list[ModuleDef]:
        """Every module, depth first in document order."""
        out: list[ModuleDef] = []
        stack = list(reversed(self.root.children.values()))
        while stack:
            mod = stack.pop()
            out.append(mod)
            stack.extend(reversed(mod.children.values()))
        return out


def check_name(value: str | None, element: Element, what: str) -> str:
    if value is None:
        raise element.error(f"<{element.tag}> needs a name attribute")
    if not NAME.fullmatch(value) or len(value) > MAX_NAME_CHARS:
        raise element.error(f"{what} name {value[:80]!r} must match {NAME.pattern} (at most {MAX_NAME_CHARS} "
                            "characters)")
    if value in RESERVED:
        raise element.error(f"{what} name {value!r} is a PML tag name")
    return value


def only_attrs(element: Element, *allowed: str) -> None:
    extra = [key for key in element.attrs if key not in allowed]
    if extra:
        raise element.error(f"<{element.tag}> has no attribute {extra[0]!r}")


class SchemaBuilder:
    """Compiles one ``<schema>`` element (see the module docstring)."""

    def __init__(self, encode: Callable[[str], list[int]], roles: Callable[[], RoleTemplate], *,
                 max_modules: int, max_tokens: int, max_param_tokens: int) -> None:
        self.encode = encode
        self.roles = roles
        self.max_modules = max_modules
        self.max_tokens = max_tokens
        self.max_param_tokens = max_param_tokens
        self.count = 0
        self.total = 0

    def build(self, root: Element) -> CompiledSchema:
        if root.tag != "schema":
            raise root.error(f"expected <schema name=...>, got <{root.tag}>")
        only_attrs(root, "name")
        name = check_name(root.attrs.get("name"), root, "schema")
        top = ModuleDef("", "")
        preamble: list[str] = []
        seen_module = False
        for child in root.children:
            if isinstance(child, Text):
                if not child.text.strip():
                    continue
                if seen_module:
                    raise PmlError("text after the first module of a schema belongs in a module or in the prompt",
                                   child.line, child.column)
                preamble.append(child.text)
            elif child.tag in ROLES:
                if seen_module:
                    raise child.error("a role tag after the first module of a schema belongs in a module")
                preamble.append(self._anonymous_role(child))
            elif child.tag in ("module", "union"):
                seen_module = True
                self._member(top, child, 1)
            else:
                raise child.error(f"unknown tag <{child.tag}> in a schema (expected module, union, system, "
                                  "user or assistant)")
        tokens = tuple(self.encode("".join(preamble))) if preamble else ()
        self._add_tokens(len(tokens), root)
        return CompiledSchema(name, top, tokens, self.total)

    def _anonymous_role(self, element: Element) -> str:
        only_attrs(element)
        texts = []
        for child in element.children:
            if not isinstance(child, Text):
                raise child.error(f"<{child.tag}> in a role tag outside any module: put the role tag in a module")
            texts.append(child.text)
        return self._role(element).wrap(element.tag, "".join(texts))

    def _role(self, element: Element) -> RoleTemplate:
        try:
            return self.roles()
        except ValueError as exc:
            raise element.error(f"<{element.tag}> cannot be used with this model: {exc}") from None

    def _add_tokens(self, n: int, element: Element) -> None:
        self.total += n
        if self.total > self.max_tokens:
            raise element.error(f"the schema has more than {self.max_tokens} tokens of module text")

    def _member(self, parent: ModuleDef, element: Element, depth: int) -> None:
        """A <module> or <union> child of ``parent``: registered and appended to its items."""
        if element.tag == "module":
            parent.items.append(Nested(self._declare(parent, element, depth, None)))
            return
        only_attrs(element)
        index = sum(isinstance(item, Choice) for item in parent.items)
        members = []
        for child in element.children:
            if isinstance(child, Text):
                if child.text.strip():
                    raise PmlError("a union holds only modules, not text", child.line, child.column)
            elif child.tag != "module":
                raise child.error(f"a union holds only modules, not <{child.tag}>")
            else:
                members.append(self._declare(parent, child, depth, index))
        if not members:
            raise element.error("a union needs at least one module")
        parent.items.append(Choice(tuple(members)))

    def _declare(self, parent: ModuleDef, element: Element, depth: int, union: int | None) -> ModuleDef:
        only_attrs(element, "name")
        name = check_name(element.attrs.get("name"), element, "module")
        if name in parent.children:
            raise element.error(f"module {name!r} is declared twice in the same place")
        self.count += 1
        if self.count > self.max_modules:
            raise element.error(f"the schema declares more than {self.max_modules} modules")
        mod = ModuleDef(name, f"{parent.path}/{name}" if parent.path else name)
        parent.children[name] = mod
        if union is not None:
            parent.union_of[name] = union
        pending: list[str] = []
        self._content(mod, element.children, pending, depth, in_role=False)
        self._flush(mod, pending, element)
        return mod

    def _flush(self, mod: ModuleDef, pending: list[str], element: Element) -> None:
        text = "".join(pending)
        pending.clear()
        if not text:
            return
        ids = tuple(self.encode(text))
        if ids:
            mod.items.append(TextPiece(ids))
            mod.tokens += len(ids)
            self._add_tokens(len(ids), element)

    def _content(self, mod: ModuleDef, children: list[Element | Text], pending: list[str], depth: int,
                 in_role: bool) -> None:
        for child in children:
            if isinstance(child, Text):
                pending.append(child.text)
            elif child.tag in ROLES:
                if in_role:
                    raise child.error(f"<{child.tag}> inside another role tag")
                only_attrs(child)
                template = self._role(child)
                pending.append(template.prefix[child.tag])
                self._content(mod, child.children, pending, depth, in_role=True)
                pending.append(template.suffix[child.tag])
            elif child.tag == "param":
                self._flush(mod, pending, child)
                mod.items.append(self._param(mod, child))
            elif child.tag in ("module", "union"):
                self._flush(mod, pending, child)
                self._member(mod, child, depth + 1)
            elif child.tag == mod.name:
                raise child.error(f"module {mod.name!r} refers to itself (a schema declares modules; only a "
                                  "prompt imports them)")
            else:
                raise child.error(f"unknown tag <{child.tag}> in a module (expected text, param, module, union, "
                                  "system, user or assistant)")

    def _param(self, mod: ModuleDef, element: Element) -> ParamSlot:
        only_attrs(element, "name", "len")
        name = check_name(element.attrs.get("name"), element, "param")
        if name in mod.params:
            raise element.error(f"param {name!r} is declared twice in module {mod.path!r}")
        if element.children:
            raise element.error("<param> must be empty (<param name=... len=N/>)")
        raw = element.attrs.get("len")
        if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 12:
            raise element.error(f"<param> needs len=N, a number of tokens, got {raw!r:.40}")
        if not 1 <= int(raw) <= self.max_param_tokens:
            raise element.error(f"param len must be between 1 and {self.max_param_tokens}, got {int(raw)}")
        slot = ParamSlot(name, int(raw))
        mod.params[name] = slot
        return slot
