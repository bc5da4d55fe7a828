"""API key format and hashing. A key is `lp-<id>.<secret>`: the id is public and
names the Redis record, the secret is stored only as a salted HMAC-SHA256."""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "lp-"
_KEY_RE = re.compile(r"lp-([0-9a-f]{16})\.([A-Za-z0-9_-]{43})")
# A dummy record so a lookup that misses still pays for one HMAC and one compare,
# keeping the timing of "unknown id" close to "wrong secret".
_DUMMY_SALT = "00" * 16
_DUMMY_HASH = "00" * 32


@dataclass(frozen=True)
class NewKey:
    key_id: str
    key: str      # shown to the user once, never stored
    salt: str     # hex
    digest: str   # hex HMAC-SHA256(salt, secret)


def digest_secret(salt_hex: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt_hex), secret.encode("utf-8"), hashlib.sha256).hexdigest()


def generate_key() -> NewKey:
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)  # 43 url-safe characters
    salt = secrets.token_hex(16)
    key = f"{KEY_PREFIX}{key_id}.{secret}"
    assert _KEY_RE.fullmatch(key), key
    return NewKey(key_id=key_id, key=key, salt=salt, digest=digest_secret(salt, secret))


def parse_key(key: object) -> tuple[str, str] | None:
    """(key_id, secret), or None for anything that is not a well-formed key."""
    if not isinstance(key, str) or len(key) > 128:
        return None
    m = _KEY_RE.fullmatch(key)
    if m is None:
        return None
    return m.group(1), m.group(2)


def verify_secret(secret: str, salt_hex: str | None, digest_hex: str | None) -> bool:
    """Constant-time check of `secret` against a stored record (None = no record)."""
    found = salt_hex is not None and digest_hex is not None
    try:
        actual = digest_secret(salt_hex if found else _DUMMY_SALT, secret)
    except ValueError:  # a corrupt salt in Redis authenticates nobody
        return False
    ok = hmac.compare_digest(actual, digest_hex if found else _DUMMY_HASH)
    return found and ok
