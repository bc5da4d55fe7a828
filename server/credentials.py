"""Secrets loraplex makes for itself (the admin token, the demo key), kept in the
data dir with owner-only permissions so every restart reuses them instead of
minting new ones."""
from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from typing import Callable

ADMIN_TOKEN_FILE = "admin-token"
DEMO_KEY_FILE = "demo-key"
SOURCE_CREDENTIALS_KEY_FILE = "source-credentials.key"


def read_secret(path: Path) -> str | None:
    try:
        value = path.read_text(encoding="utf-8").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return value or None


def write_secret(path: Path, value: str) -> None:
    """Atomically replace `path` with `value`, readable by the owner only from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(value + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_or_create_secret(path: Path, make: Callable[[], str]) -> str:
    value = read_secret(path)
    if value is None:
        value = make()
        write_secret(path, value)
    return value


def load_or_create_key(path: Path, nbytes: int) -> bytes:
    """A random binary key of `nbytes`, kept base64 in `path` (owner-only); made at first use."""
    text = load_or_create_secret(path, lambda: base64.b64encode(os.urandom(nbytes)).decode())
    try:
        key = base64.b64decode(text, validate=True)
    except binascii.Error:
        key = b""
    if len(key) != nbytes:
        raise ValueError(f"{path} does not hold a base64 key of {nbytes} bytes")
    return key
