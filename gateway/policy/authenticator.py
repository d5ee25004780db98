"""Maps a request's bearer token to its :class:`Tenant`.

With a config, only listed key hashes authenticate (anything else is 401). In open
mode (no config) every distinct bearer token is its own isolated tenant named
``open-<first 32 hex of its SHA-256>`` (128 bits, :func:`gateway.policy.tenant_names.open_tenant_id`;
reports show a shorter label), and a request without a token is tenant
``anonymous`` -- a local convenience, announced at start-up.
"""

from __future__ import annotations

from gateway.config.config_file import GatewayConfig, Tenant
from gateway.errors import Forbidden, Unauthorized
from gateway.policy.api_key import hash_key
from gateway.policy.tenant_names import open_tenant_id

ANONYMOUS = "anonymous"


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    def __init__(self, config: GatewayConfig, *, open_mode: bool) -> None:
        self.config = config
        self.open_mode = open_mode

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant for an ``Authorization`` header; raises :class:`Unauthorized`."""
        token = bearer_token(authorization)
        if self.open_mode:
            if token is None:
                return Tenant(name=ANONYMOUS)
            return Tenant(name=open_tenant_id(token))
        if token is None:
            raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        name = self.config.key_hashes.get(hash_key(token))
        if name is None:
            raise Unauthorized("Invalid API key.")
        return self.config.tenants[name]

    def require_admin(self, authorization: str | None) -> None:
        """Return for an admin key. 403 ``admin_key_required`` for a valid tenant key,
        403 ``no_admin_key_configured`` when none exists, 401 for anything else."""
        token = bearer_token(authorization)
        if not self.config.admin_key_hashes:
            raise Forbidden(
                "No admin key is configured: add 'admin_keys' under [server] "
                "(see 'prefixgate keys create --admin').",
                code="no_admin_key_configured",
            )
        key_hash = hash_key(token) if token is not None else None
        if key_hash in self.config.admin_key_hashes:
            return
        if key_hash in self.config.key_hashes:
            raise Forbidden("This endpoint needs an admin API key; this key belongs to a tenant.",
                            code="admin_key_required")
        raise Unauthorized("This endpoint needs an admin API key.")
