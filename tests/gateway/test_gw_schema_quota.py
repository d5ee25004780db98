"""SchemaQuota: namespaces and module tokens per tenant (the HTTP side is tested with the real
engine in tests/engine/server/test_engine_http_prompt_modules_gateway.py)."""

from __future__ import annotations

import pytest

from gateway.errors import InvalidRequest
from gateway.policy.schema_quota import SchemaQuota


def test_namespaces_are_reserved_while_registering_and_freed_by_the_last_delete() -> None:
    quota = SchemaQuota(max_namespaces=2, max_tokens=100)
    with quota.registering("t", None), quota.registering("t", "a"):  # two registrations under way: both held
        with pytest.raises(InvalidRequest) as refused, quota.registering("t", "b"):
            pass
        assert refused.value.param == "cache_salt" and refused.value.code == "schema_limit"
        with quota.registering("other", "b"):  # other tenants are not affected
            pass
        quota.registered("t", "a", "s", 10)
    assert quota.namespaces("t") == 1  # the unsalted registration never completed
    with quota.registering("t", "a"):
        quota.registered("t", "a", "s", 30)  # a replacement counts once
    assert quota.tokens("t") == 30
    with quota.registering("t", None):
        with pytest.raises(InvalidRequest) as over:
            quota.registered("t", None, "big", 71)
        assert over.value.param == "pml"
        quota.registered("t", None, "fits", 70)
    with pytest.raises(InvalidRequest), quota.registering("t", "b"):
        pass
    quota.deleted("t", None, "fits")
    quota.deleted("t", "zzz", "nothing")
    with quota.registering("t", "b"):
        pass
    quota.deleted("t", "a", "s")
    assert quota.namespaces("t") == 0 and quota.tokens("t") == 0
    quota.check_integrity()
    with pytest.raises(ValueError):
        SchemaQuota(max_namespaces=0)
