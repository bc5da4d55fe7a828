"""S3 keys as loraplex sends them: exactly the segments the client wrote. A store (or a proxy in
front of one) that normalises `a/../b` to `b` would otherwise serve a key outside the prefix the
bucket allowlist was checked against, so dot segments and empty segments are refused, not sent."""
from __future__ import annotations

from urllib.parse import unquote


def s3_key_problem(key: str) -> str | None:
    """Why `key` may not be requested (None: it may)."""
    for segment in key.split("/"):
        if segment == "":
            return "an S3 key may not hold an empty segment ('//', or a leading '/')"
        if unquote(segment) in (".", ".."):
            return "an S3 key may not hold a '.' or '..' segment"
    return None
