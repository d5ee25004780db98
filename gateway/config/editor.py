"""Adding a key hash to a TOML config file without disturbing the rest of it.

The edit is textual (comments and layout are kept): the hash is appended to the
``keys`` (or ``admin_keys``) array of the right table, or a new table/line is
added. The result is re-parsed and validated before the file is replaced
atomically, keeping its mode (a new file is 0600: it may hold the server secret);
on any doubt a ``ValueError`` leaves the file untouched.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import tomllib
from pathlib import Path

from gateway.config.config_file import parse_config


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
    _replace(path, new_text.encode("utf-8"))


def _replace(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``, keeping its mode (a new file: 0600,
    as a config may hold the server secret). The temporary file is created with
    that mode, so the content is never readable by others, not even for a moment."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o600
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)  # the umask may have narrowed it
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


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
