"""PromptBuilder: a PML ``<prompt schema=...>`` compiled against its schema into a SegmentedPrompt.

Syntax::

    <prompt schema="docs">
      <user><doc-fr/><intro who="Ana"/><book><ch1/></book>What changed?</user>
      <assistant/>
    </prompt>

* children are, in order: text (uncached; whitespace-only text between elements
  outside role tags is ignored), role tags (the model's chat template glue around
  their content, uncached) and imports: an element named after a top-level module,
  whose attributes are the module's param values and whose children import its
  nested modules (``<book><ch1/></book>``);
* a final empty ``<assistant/>`` is the generation prompt (what
  ``add_generation_prompt`` appends); any other role tag is a whole message;
* the schema's anonymous content (its preamble) comes first, as one reusable segment.

The result, in prompt order: the tokenizer's leading special tokens (a BOS, where
the tokenizer adds one) uncached, the preamble, then each child. An imported module
becomes one reusable :class:`~engine.promptcache.segments.Segment` per text piece
(named ``schema/path``, pieces after a param ``schema/path#k``); param values and
prompt text are uncached segments. Errors (a :class:`~engine.promptcache.pml_syntax.PmlError`
at the element): unknown module, schema or tag, an unknown param, a value longer
than its ``len``, a module imported twice, two members of one union, text inside an import.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.promptcache.chat_roles import ROLES, RoleTemplate
from engine.promptcache.pml_schema import (
    Choice,
    CompiledSchema,
    ModuleDef,
    Nested,
    ParamSlot,
    TextPiece,
    only_attrs,
)
from engine.promptcache.pml_syntax import Element, PmlError, Text
from engine.promptcache.segments import Recovery, Segment, SegmentedPrompt


class PromptBuilder:
    """Builds one prompt; ``schemas`` looks a schema up by name (None: unknown)."""

    def __init__(self, encode: Callable[[str], list[int]], roles: Callable[[], RoleTemplate],
                 leading: tuple[int, ...], schemas: Callable[[str], CompiledSchema | None]) -> None:
        self.encode = encode
        self.roles = roles
        self.schemas = schemas
        self.segments: list[Segment] = []
        self.pending: list[str] = []  # uncached text not yet tokenized
        self.uncached: list[int] = list(leading)
        self.schema: CompiledSchema | None = None

    def build(self, root: Element, recovery: Recovery) -> SegmentedPrompt:
        if root.tag != "prompt":
            raise root.error(f"expected <prompt schema=...>, got <{root.tag}>")
        only_attrs(root, "schema")
        name = root.attrs.get("schema")
        if name is None:
            raise root.error("<prompt> needs a schema attribute")
        schema = self.schemas(name)
        if schema is None:
            raise root.error(f"unknown schema {name[:80]!r} (register it with POST /v1/prompt_schemas)")
        self.schema = schema
        if schema.preamble:
            self._cached(schema.preamble, f"{schema.name}/@preamble")
        elements = [c for c in root.children if isinstance(c, Element)]
        last = elements[-1] if elements else None
        used: dict[str, Element] = {}
        for child in root.children:
            if isinstance(child, Text):
                if child.text.strip():
                    self.pending.append(child.text)
            elif child.tag in ROLES:
                self._role(child, used, generation=child is last and child.tag == "assistant" and not child.children)
            else:
                self._import(schema.root, child, used)
        self._flush()
        if not self.segments:
            raise root.error("the prompt is empty")
        return SegmentedPrompt(tuple(self.segments), recovery)

    # ------------------------------------------------------------ segments
    def _flush(self) -> None:
        if self.pending:
            self.uncached.extend(self.encode("".join(self.pending)))
            self.pending.clear()
        if self.uncached:
            self.segments.append(Segment(tuple(self.uncached)))
            self.uncached = []

    def _cached(self, token_ids: tuple[int, ...], module: str) -> None:
        self._flush()
        self.segments.append(Segment(token_ids, module))

    # ------------------------------------------------------------- content
    def _role(self, element: Element, used: dict[str, Element], generation: bool) -> None:
        only_attrs(element)
        try:
            template = self.roles()
        except ValueError as exc:
            raise element.error(f"<{element.tag}> cannot be used with this model: {exc}") from None
        if generation:
            self.pending.append(template.generation)
            return
        assert self.schema is not None
        self.pending.append(template.prefix[element.tag])
        for child in element.children:
            if isinstance(child, Text):
                self.pending.append(child.text)
            elif child.tag in ROLES:
                raise child.error(f"<{child.tag}> inside another role tag")
            else:
                self._import(self.schema.root, child, used)
        self.pending.append(template.suffix[element.tag])

    def _import(self, parent: ModuleDef, element: Element, used: dict[str, Element]) -> None:
        """Import ``element.tag``, a module nested in ``parent`` (the schema's top level or a
        module), checking it against the imports already in ``used`` (same parent)."""
        mod = parent.children.get(element.tag)
        if mod is None:
            where = f"module {parent.path!r}" if parent.path else f"schema {self._schema_name()!r}"
            raise element.error(f"{where} has no module {element.tag!r}")
        if element.tag in used:
            first = used[element.tag]
            raise element.error(f"module {mod.path!r} is imported twice (first at line {first.line}, "
                                f"column {first.column})")
        union = parent.union_of.get(element.tag)
        if union is not None:
            rival = next((n for n in used if parent.union_of.get(n) == union), None)
            if rival is not None:
                raise element.error(f"modules {rival!r} and {element.tag!r} are members of one union: import one")
        used[element.tag] = element
        self._expand(mod, element)

    def _expand(self, mod: ModuleDef, element: Element) -> None:
        for key in element.attrs:
            if key not in mod.params:
                raise element.error(f"module {mod.path!r} has no param {key!r}")
        nested: dict[str, Element] = {}
        for child in element.children:
            if isinstance(child, Text):
                if child.text.strip():
                    raise PmlError(f"text inside the import of {mod.path!r} (only nested imports go there)",
                                   child.line, child.column)
            else:
                self._check_nested(mod, child, nested)
        name = f"{self._schema_name()}/{mod.path}"
        piece = 0
        for item in mod.items:
            if isinstance(item, TextPiece):
                self._cached(item.token_ids, name if piece == 0 else f"{name}#{piece}")
                piece += 1
            elif isinstance(item, ParamSlot):
                self._param(mod, item, element)
            elif isinstance(item, Nested):
                if item.module.name in nested:
                    self._expand(item.module, nested[item.module.name])
            elif isinstance(item, Choice):
                chosen = next((m for m in item.members if m.name in nested), None)
                if chosen is not None:
                    self._expand(chosen, nested[chosen.name])

    def _check_nested(self, mod: ModuleDef, child: Element, nested: dict[str, Element]) -> None:
        if child.tag not in mod.children:
            raise child.error(f"module {mod.path!r} has no nested module {child.tag!r}")
        if child.tag in nested:
            raise child.error(f"module {mod.path}/{child.tag} is imported twice")
        union = mod.union_of.get(child.tag)
        rival = next((n for n in nested if union is not None and mod.union_of.get(n) == union), None)
        if rival is not None:
            raise child.error(f"modules {rival!r} and {child.tag!r} are members of one union: import one")
        nested[child.tag] = child

    def _param(self, mod: ModuleDef, slot: ParamSlot, element: Element) -> None:
        value = element.attrs.get(slot.name)
        if not value:
            return
        ids = self.encode(value)
        if len(ids) > slot.max_tokens:
            raise element.error(f"the value of param {slot.name!r} of module {mod.path!r} has {len(ids)} "
                                f"tokens, more than its len={slot.max_tokens}")
        self._flush()
        self.uncached.extend(ids)
        self._flush()

    def _schema_name(self) -> str:
        assert self.schema is not None
        return self.schema.name
