"""The embedded Redis's password: generated once into the data dir, owner-only.

Files here are created 0600 from the first byte on (os.open with a mode, not
chmod after writing), so another local user never gets a window to read them.
"""
from __future__ import annotations

import logging
import os
import re
import secrets
from pathlib import Path

log = logging.getLogger(__name__)

PASSWORD_NAME = "redis.password"
# Printable ASCII without space and quotes: redis's config parser takes such a
# token literally, so the password needs no escaping in redis.conf.
_CONF_SAFE = re.compile(r"[!#-&(-~]+")


class PasswordFileError(ValueError):
    """The password file exists but does not hold a usable password."""


def load_or_create_password(data_dir: Path) -> str:
    """The data dir's Redis password, generated on first use and kept after."""
    path = data_dir / PASSWORD_NAME
    if not path.exists():
        write_private(path, secrets.token_urlsafe(32) + "\n", overwrite=False)
    with open(path) as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            log.warning("%s was readable by other users; restricting it to its owner", path)
            os.fchmod(f.fileno(), 0o600)
        password = f.read().strip()
    if not _CONF_SAFE.fullmatch(password):
        raise PasswordFileError(
            f"{path} must hold one password of printable ASCII without spaces or quotes; "
            "delete it to have a new one generated")
    return password


def write_private(path: Path, text: str, *, overwrite: bool) -> bool:
    """Write `text` to `path` as a 0600 file, complete or not at all (staged,
    then renamed or linked into place). Without `overwrite`, an existing `path`
    is left alone and False returned: with two processes racing to create the
    password, the first one's wins and both use it."""
    staged = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    # O_EXCL: never write through a file or symlink someone planted at this path.
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(staged, path)
            return True
        try:
            os.link(staged, path)  # unlike rename, link never replaces an existing file
        except FileExistsError:
            return False
        return True
    finally:
        staged.unlink(missing_ok=True)
