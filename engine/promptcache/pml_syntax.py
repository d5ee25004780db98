"""PML syntax: a small, safe XML reader for Prompt Markup Language documents.

PML (Prompt Cache's Prompt Markup Language) is written in XML syntax; this module
turns a document into a tree of :class:`Element` and :class:`Text` nodes, each with
the line and column where it starts. It is hand-written on purpose: it knows only
what PML needs and nothing that makes XML parsers dangerous.

Accepted: elements with attributes (``name="v"`` or ``name='v'``), self-closing
elements, text, the five predefined entities (``&lt; &gt; &amp; &quot; &apos;``),
character references (``&#65;``, ``&#x41;``), comments and CDATA sections. Refused
with a :class:`PmlError`: a DOCTYPE or any other ``<!`` declaration (so no entity
can be declared and no "billion laughs" expansion exists), processing instructions,
unknown entities, duplicate attributes, mismatched tags, text outside the root
element, and anything past the bounds below.

Bounds (bounded work per document): :data:`MAX_PML_CHARS` characters,
:data:`MAX_DEPTH` levels of nesting, :data:`MAX_ELEMENTS` elements,
:data:`MAX_NAME_CHARS` characters per tag or attribute name and
:data:`MAX_ATTRIBUTES` attributes per element.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_PML_CHARS = 4 * 1024 * 1024
MAX_DEPTH = 32
MAX_ELEMENTS = 4096
MAX_NAME_CHARS = 64
MAX_ATTRIBUTES = 32

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
_SPACE = re.compile(r"[ \t\r\n]*")
_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}
_REFERENCE = re.compile(r"&(#[0-9]{1,7}|#x[0-9A-Fa-f]{1,6}|[A-Za-z][A-Za-z0-9]{0,31});")


class PmlError(ValueError):
    """A PML document that cannot be read or compiled, with the line and column (1-based)
    where the problem is; ``str()`` names them."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"PML error at line {line}, column {column}: {message}")
        self.reason = message
        self.line = line
        self.column = column


@dataclass
class Text:
    """Character data (entities already replaced)."""

    text: str
    line: int
    column: int


@dataclass
class Element:
    """An element: tag, attributes in document order, children in document order."""

    tag: str
    attrs: dict[str, str]
    line: int
    column: int
    children: list[Element | Text] = field(default_factory=list)

    def error(self, message: str) -> PmlError:
        """A PmlError located at this element's start."""
        return PmlError(message, self.line, self.column)


class _Reader:
    def __init__(self, source: str) -> None:
        self.src = source
        self.pos = 0
        self.elements = 0
        self._line_starts = [0] + [m.end() for m in re.finditer("\n", source)]

    def where(self, pos: int) -> tuple[int, int]:
        lo, hi = 0, len(self._line_starts) - 1
        while lo < hi:  # the last line start <= pos
            mid = (lo + hi + 1) // 2
            if self._line_starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1, pos - self._line_starts[lo] + 1

    def fail(self, message: str, pos: int | None = None) -> PmlError:
        line, column = self.where(self.pos if pos is None else pos)
        return PmlError(message, line, column)

    def skip_space(self) -> None:
        m = _SPACE.match(self.src, self.pos)
        assert m is not None
        self.pos = m.end()

    def name(self, what: str) -> str:
        m = _NAME.match(self.src, self.pos)
        if m is None:
            raise self.fail(f"expected a {what} name")
        if len(m.group()) > MAX_NAME_CHARS:
            raise self.fail(f"a {what} name has more than {MAX_NAME_CHARS} characters")
        self.pos = m.end()
        return m.group()

    def unescape(self, raw: str, start: int) -> str:
        if "&" not in raw:
            return raw
        out: list[str] = []
        last = 0
        for m in _REFERENCE.finditer(raw):
            amp = raw.find("&", last, m.start())
            if amp != -1:
                raise self.fail("'&' must be written as &amp;", start + amp)
            out.append(raw[last:m.start()])
            ref = m.group(1)
            if ref.startswith("#"):
                code = int(ref[2:], 16) if ref.startswith("#x") else int(ref[1:])
                if not 0 < code <= 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                    raise self.fail(f"character reference {m.group()} is not a valid character", start + m.start())
                out.append(chr(code))
            elif ref in _ENTITIES:
                out.append(_ENTITIES[ref])
            else:
                raise self.fail(f"unknown entity {m.group()} (only lt, gt, amp, quot, apos and "
                                "character references exist in PML)", start + m.start())
            last = m.end()
        amp = raw.find("&", last)
        if amp != -1:
            raise self.fail("'&' must be written as &amp;", start + amp)
        out.append(raw[last:])
        return "".join(out)

    def attributes(self) -> dict[str, str]:
        attrs: dict[str, str] = {}
        while True:
            before = self.pos
            self.skip_space()
            if self.src.startswith(("/>", ">"), self.pos):
                return attrs
            if self.pos == before:
                raise self.fail("expected whitespace, '>' or '/>'")
            at = self.pos
            key = self.name("attribute")
            if key in attrs:
                raise self.fail(f"attribute {key!r} is given twice", at)
            if len(attrs) >= MAX_ATTRIBUTES:
                raise self.fail(f"more than {MAX_ATTRIBUTES} attributes on one element", at)
            self.skip_space()
            if not self.src.startswith("=", self.pos):
                raise self.fail(f"attribute {key!r} needs a value (name=\"value\")")
            self.pos += 1
            self.skip_space()
            quote = self.src[self.pos:self.pos + 1]
            if quote not in ('"', "'"):
                raise self.fail(f"the value of attribute {key!r} must be quoted")
            end = self.src.find(quote, self.pos + 1)
            if end == -1:
                raise self.fail(f"the value of attribute {key!r} is not closed")
            raw = self.src[self.pos + 1:end]
            if "<" in raw:
                raise self.fail("'<' must be written as &lt; in an attribute value", self.pos + 1 + raw.index("<"))
            attrs[key] = self.unescape(raw, self.pos + 1)
            self.pos = end + 1

    def document(self) -> Element:
        self.skip_space()
        if self.src.startswith("<?xml", self.pos):
            end = self.src.find("?>", self.pos)
            if end == -1:
                raise self.fail("the XML declaration is not closed")
            self.pos = end + 2
        self.misc()
        if not self.src.startswith("<", self.pos) or self.src.startswith("</", self.pos):
            raise self.fail("expected a root element")
        root = self.element(1)
        self.misc()
        if self.pos != len(self.src):
            raise self.fail("only whitespace and comments may follow the root element")
        return root

    def misc(self) -> None:
        while True:
            self.skip_space()
            if self.src.startswith("<!--", self.pos):
                self.comment()
            elif self.src.startswith("<!", self.pos) or self.src.startswith("<?", self.pos):
                raise self.fail("declarations (DOCTYPE, ENTITY) and processing instructions are not allowed in PML")
            else:
                return

    def comment(self) -> None:
        end = self.src.find("-->", self.pos + 4)
        if end == -1:
            raise self.fail("a comment is not closed")
        self.pos = end + 3

    def element(self, depth: int) -> Element:
        if depth > MAX_DEPTH:
            raise self.fail(f"elements are nested more than {MAX_DEPTH} levels deep")
        self.elements += 1
        if self.elements > MAX_ELEMENTS:
            raise self.fail(f"the document has more than {MAX_ELEMENTS} elements")
        start = self.pos
        self.pos += 1  # '<'
        tag = self.name("tag")
        line, column = self.where(start)
        node = Element(tag, self.attributes(), line, column)
        if self.src.startswith("/>", self.pos):
            self.pos += 2
            return node
        self.pos += 1  # '>'
        while True:
            text_start = self.pos
            lt = self.src.find("<", self.pos)
            if lt == -1:
                raise self.fail(f"element <{tag}> is not closed", start)
            if lt > self.pos:
                raw = self.src[self.pos:lt]
                if "]]>" in raw:
                    raise self.fail("']]>' is not allowed in text", self.pos + raw.index("]]>"))
                t_line, t_col = self.where(text_start)
                self._add_text(node, self.unescape(raw, text_start), t_line, t_col)
                self.pos = lt
            if self.src.startswith("</", self.pos):
                close = self.pos
                self.pos += 2
                end_tag = self.name("tag")
                self.skip_space()
                if not self.src.startswith(">", self.pos):
                    raise self.fail("expected '>'")
                self.pos += 1
                if end_tag != tag:
                    raise self.fail(f"</{end_tag}> does not close <{tag}> (opened at line {line}, column {column})",
                                    close)
                return node
            if self.src.startswith("<!--", self.pos):
                self.comment()
            elif self.src.startswith("<![CDATA[", self.pos):
                end = self.src.find("]]>", self.pos + 9)
                if end == -1:
                    raise self.fail("a CDATA section is not closed")
                c_line, c_col = self.where(self.pos)
                self._add_text(node, self.src[self.pos + 9:end], c_line, c_col)
                self.pos = end + 3
            elif self.src.startswith(("<!", "<?"), self.pos):
                raise self.fail("declarations (DOCTYPE, ENTITY) and processing instructions are not allowed in PML")
            else:
                node.children.append(self.element(depth + 1))

    @staticmethod
    def _add_text(node: Element, text: str, line: int, column: int) -> None:
        last = node.children[-1] if node.children else None
        if isinstance(last, Text):  # text split by a comment or CDATA is one run
            last.text += text
        elif text:
            node.children.append(Text(text, line, column))


def parse_pml(source: str) -> Element:
    """The root element of a PML document; :class:`PmlError` (a ValueError) naming the
    line and column of the first problem. Pure: no I/O, no entity expansion."""
    if not isinstance(source, str):
        raise PmlError("a PML document must be a string", 1, 1)
    if len(source) > MAX_PML_CHARS:
        raise PmlError(f"the document has {len(source)} characters, more than {MAX_PML_CHARS}", 1, 1)
    if "\x00" in source:
        line_col = _Reader(source).where(source.index("\x00"))
        raise PmlError("NUL characters are not allowed", *line_col)
    return _Reader(source).document()
