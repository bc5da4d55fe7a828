"""One `loraplex serve` per data dir: an flock on DATA_DIR/serve.lock, holding the holder's pid.

Taken before the model loads, so a second server on the same data dir (its embedded Redis, its
tokens) is refused in a second, not after a minute of loading and a Redis pidfile traceback. The
kernel drops the lock when its holder dies however it dies, so a crash never leaves a stale lock.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from server.config import ConfigError

LOCK_NAME = "serve.lock"


def hold_data_dir(data_dir: Path) -> IO[str]:
    """The open lock file; the lock lasts while it stays open. ConfigError names the holder."""
    path = data_dir / LOCK_NAME
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        raise ConfigError(f"--data-dir {data_dir}: cannot write there ({e.strerror or e}); pass a directory "
                          "this user can write") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(f"--data-dir {data_dir} is in use by another loraplex serve (pid {holder}, "
                          f"see {path}): stop it, or pass another --data-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
