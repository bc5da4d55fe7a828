"""Test helpers shared by the tenants/ test files."""
from __future__ import annotations

from tenants import Quota, Tenant

ACME_ID = "00000000000ac0e0"


def make_tenant(**quota: object) -> Tenant:
    """A tenant value that is not in any store (enough for the Limiter)."""
    return Tenant(name="acme", id=ACME_ID, quota=Quota(**quota))
