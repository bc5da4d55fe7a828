"""SourceCredentials: a tenant's own credentials for adapter sources (today: S3), kept encrypted
in Redis, so a tenant can register adapters from its own bucket without the operator's keys.

- Encrypted with AES-256-GCM under a server key that never enters Redis (the operator keeps it in
  the data dir, or one file shared by every replica). Someone who reads Redis learns which tenants
  set credentials and the last 4 characters of each access key id, nothing else.
- Each ciphertext is bound to its tenant id and source kind (GCM's associated data): a blob copied
  under another tenant's key does not decrypt, so a Redis write cannot lend one tenant's
  credentials to another.
- Never echoed: what the API reads back is `describe()`, the kind, the key id's last 4 characters
  and when they were set.

Deleted with the tenant (TenantStore.delete names this key).
"""
from __future__ import annotations

import base64
import json
import os
import re
import time
from dataclasses import dataclass, field

import redis
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tenants.errors import CredentialError
from tenants.models import Keyspace, as_str

KEY_BYTES = 32
_NONCE_BYTES = 12
_ACCESS_KEY_ID = re.compile(r"[A-Za-z0-9_\-]{3,128}")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
MAX_SECRET_CHARS = 256
MAX_SESSION_TOKEN_CHARS = 4096


@dataclass(frozen=True)
class S3Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)  # repr: never in a log line or a traceback
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.access_key_id, str) or not _ACCESS_KEY_ID.fullmatch(self.access_key_id):
            raise CredentialError("access_key_id", "access_key_id must be 3-128 letters, digits, '_' or '-'")
        if (not isinstance(self.secret_access_key, str) or len(self.secret_access_key) > MAX_SECRET_CHARS
                or not _PRINTABLE.fullmatch(self.secret_access_key)):
            raise CredentialError("secret_access_key", f"secret_access_key must be 1-{MAX_SECRET_CHARS} "
                                  "printable ASCII characters without spaces")
        if self.session_token is not None and (
                not isinstance(self.session_token, str) or len(self.session_token) > MAX_SESSION_TOKEN_CHARS
                or not _PRINTABLE.fullmatch(self.session_token)):
            raise CredentialError("session_token", f"session_token must be 1-{MAX_SESSION_TOKEN_CHARS} "
                                  "printable ASCII characters without spaces")

    @property
    def hint(self) -> str:
        """What may be shown of them: the access key id's last 4 characters."""
        return "..." + self.access_key_id[-4:]


KINDS = {"s3": S3Credentials}


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


class SourceCredentials:
    def __init__(self, client: redis.Redis, key: bytes, prefix: str = "lp:") -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the source-credentials key must be {KEY_BYTES} bytes, got {len(key)}")
        self._r = client
        self._ks = Keyspace(prefix)
        self._aead = AESGCM(key)

    @staticmethod
    def _aad(tenant_id: str, kind: str) -> bytes:
        return f"loraplex-source-credentials\0{tenant_id}\0{kind}".encode()

    def put(self, tenant_id: str, kind: str, credentials: S3Credentials) -> dict:
        assert kind in KINDS and isinstance(credentials, KINDS[kind]), kind
        plain = json.dumps({"access_key_id": credentials.access_key_id,
                            "secret_access_key": credentials.secret_access_key,
                            "session_token": credentials.session_token}).encode()
        nonce = os.urandom(_NONCE_BYTES)
        sealed = base64.b64encode(nonce + self._aead.encrypt(nonce, plain, self._aad(tenant_id, kind)))
        meta = {"kind": kind, "access_key_id": credentials.hint, "updated_at": int(time.time())}
        self._r.hset(self._ks.source_credentials(tenant_id),
                     mapping={f"{kind}:sealed": sealed, f"{kind}:meta": json.dumps(meta)})
        return meta

    def get(self, tenant_id: str, kind: str) -> S3Credentials | None:
        """The tenant's credentials for `kind`, None if it set none (or they no longer decrypt under
        this server's key, which is the same to the tenant: set them again)."""
        assert kind in KINDS, kind
        sealed = self._r.hget(self._ks.source_credentials(tenant_id), f"{kind}:sealed")
        if sealed is None:
            return None
        try:
            raw = base64.b64decode(sealed, validate=True)
            plain = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], self._aad(tenant_id, kind))
            return KINDS[kind](**json.loads(plain))
        except (InvalidTag, ValueError, TypeError):
            return None

    def describe(self, tenant_id: str) -> list[dict]:
        fields = self._r.hgetall(self._ks.source_credentials(tenant_id))
        metas = [json.loads(as_str(v)) for k, v in fields.items() if as_str(k).endswith(":meta")]
        return sorted(metas, key=lambda m: m["kind"])

    def delete(self, tenant_id: str, kind: str) -> bool:
        assert kind in KINDS, kind
        return bool(self._r.hdel(self._ks.source_credentials(tenant_id), f"{kind}:sealed", f"{kind}:meta"))
