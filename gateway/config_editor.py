"""Adding a key hash to a TOML config file without disturbing the rest of it.

The edit is textual (comments and layout are kept): the hash is appended to the
``keys`` (or ``admin_keys``) array of the right table, or a new table/line is
added. The result is re-parsed and validated before the file is replaced
atomically; on any doubt a ``ValueError`` leaves the file untouched.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from gateway.config import parse_config


def add_key_hash(path: Path, tenant: str | None, key_hash: str) -> None:
    """Add ``key_hash`` to tenant ``tenant`` (``None``: to ``[server] admin_keys``)."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    table = "server" if tenant is None else f"tenants.{tenant}"
    field = "admin_keys" if tenant is None else "keys"
    new_text = _edited(text, table, field, key_hash)
    try:
        parsed = tomllib.loads(new_text)
        parse_config(parsed)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: could not add the key automatically ({exc}); add it by hand") from exc
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(new_text, encoding="utf-8")
    os.replace(temp, path)


def _edited(text: str, table: str, field: str, key_hash: str) -> str:
    header = re.compile(r"^\[" + re.escape(table) + r"\]\s*(#.*)?$", re.MULTILINE)
    match = header.search(text)
    if match is None:
        prefix = text if not text or text.endswith("\n") else text + "\n"
        separator = "\n" if prefix else ""
        return f'{prefix}{separator}[{table}]\n{field} = ["{key_hash}"]\n'
    body_start = match.end()
    next_table = re.compile(r"^\[", re.MULTILINE).search(text, body_start)
    body_end = next_table.start() if next_table else len(text)
    body = text[body_start:body_end]
    line = re.compile(r"^(" + re.escape(field) + r"\s*=\s*\[)([^\]]*)\]", re.MULTILINE).search(body)
    if line is None:
        insert = f'\n{field} = ["{key_hash}"]'
        return text[:body_start] + insert + text[body_start:]
    items = line.group(2).rstrip()
    joined = f'{items}, "{key_hash}"' if items.strip().rstrip(",").strip() else f'"{key_hash}"'
    if items.rstrip().endswith(","):
        joined = f'{items} "{key_hash}"'
    new_body = body[: line.start()] + line.group(1) + joined + "]" + body[line.end() :]
    return text[:body_start] + new_body + text[body_end:]
