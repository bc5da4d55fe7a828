"""Test helpers shared by the tenants/ test files."""
from __future__ import annotations

from tenants import Quota, Tenant


def make_tenant(**quota: object) -> Tenant:
    return Tenant(name="acme", quota=Quota(**quota))
