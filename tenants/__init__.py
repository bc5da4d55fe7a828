"""Tenants, API keys, quotas, usage accounting and rate limits, backed by Redis.

Imports nothing from server/. Every Redis key lives under a prefix ("lp:" by default).
"""
from tenants.errors import (QuotaError, QuotaExceeded, RequestTooLarge, TenantConcurrentChange,
                            TenantError, TenantExists, TenantIdError, TenantNameError,
                            TenantNotFound)
from tenants.limits import Admission, AuthThrottle, Limiter, RunUsage, UsageLog, check_request_tokens
from tenants.models import Keyspace, Quota, Tenant, validate_tenant_id, validate_tenant_name
from tenants.refusals import REASONS as REFUSAL_REASONS
from tenants.refusals import RefusalLog
from tenants.store import TenantStore

__all__ = [
    "Admission", "AuthThrottle", "Keyspace", "Limiter", "Quota", "QuotaError", "QuotaExceeded",
    "REFUSAL_REASONS", "RefusalLog", "RunUsage", "RequestTooLarge", "Tenant", "TenantConcurrentChange", "TenantError", "TenantExists",
    "TenantIdError", "TenantNameError", "TenantNotFound", "TenantStore", "UsageLog",
    "check_request_tokens", "validate_tenant_id", "validate_tenant_name",
]
