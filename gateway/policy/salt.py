"""Server-side cache salts and the server secret.

The salt sent upstream is ``HMAC-SHA256(secret, message)`` in hex, where
``message = scope`` without a client salt and ``scope || 0x00 || client_salt``
with one. Scopes (``tenant:NAME`` / ``group:NAME``) never contain NUL, so the
encoding is unambiguous: two different (scope, client salt) pairs never give the
same message. Hence a client salt only narrows its own scope and can never equal
another scope's salt. A ``shared`` tenant without a client salt sends no salt.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

SECRET_ENV = "PREFIXGATE_SECRET"


def derive_cache_salt(secret: bytes, scope: str | None, client_salt: str | None) -> str | None:
    if scope is None and client_salt is None:
        return None
    message = (scope or "shared").encode("utf-8")
    assert b"\x00" not in message, "scopes are validated names"
    if client_salt is not None:
        message += b"\x00" + client_salt.encode("utf-8")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def exposed_secret_warning(path: Path) -> str | None:
    """One line when ``path`` (a file holding the server secret) is readable by its
    group or by everyone, else None (also when it cannot be inspected). Whoever reads
    the secret can compute every tenant's cache salt."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o044:
        return None
    who = "everyone" if mode & 0o004 else "its group"
    return (f"{path} holds the server secret and is readable by {who} (mode {mode:04o}); "
            f"anyone who reads it can derive every tenant's cache salt: run 'chmod 600 {path}'")


def secret_files(data_dir: Path, config_path: Path | None, configured: str | None) -> list[Path]:
    """The files that hold the secret :func:`load_or_create_secret` uses: the config
    when it sets one, else ``data_dir/secret`` unless ``$PREFIXGATE_SECRET`` is set."""
    if configured:
        return [config_path] if config_path is not None else []
    if os.environ.get(SECRET_ENV):
        return []
    return [data_dir / "secret"]


def load_or_create_secret(data_dir: Path, configured: str | None = None) -> bytes:
    """The server secret: from the config, else ``$PREFIXGATE_SECRET``, else ``data_dir/secret``.

    The file is created on first use with 0600 permissions (atomically, so two
    processes starting together agree) and reused afterwards.
    """
    if configured:
        return configured.encode("utf-8")
    from_env = os.environ.get(SECRET_ENV)
    if from_env:
        return from_env.encode("utf-8")
    path = data_dir / "secret"
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        temp = data_dir / f".secret.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(secrets.token_hex(32) + "\n")
        try:
            os.link(temp, path)  # atomic; fails if another process won the race
        except FileExistsError:
            pass
        finally:
            temp.unlink()
    value = path.read_text(encoding="ascii").strip()
    if len(value) < 32:
        raise ValueError(f"{path}: the secret file is truncated or empty")
    return value.encode("ascii")
