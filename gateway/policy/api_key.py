"""API keys: generation and the hashed form stored in the config.

Only ``sha256:<hex>`` hashes are ever stored or compared. A presented key is hashed
first and the fixed-length digest is looked up, so the comparison never depends on
how much of a secret key an attacker guessed right.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "pg-"


def generate_key() -> str:
    """A new random API key (256 bits of entropy)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_matches(key: str, key_hash: str) -> bool:
    return hmac.compare_digest(hash_key(key), key_hash)
