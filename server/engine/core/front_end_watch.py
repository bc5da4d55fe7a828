"""FrontEndWatch: whether the core's front end (a pid in its CoreLaunch) has exited.

Not getppid(): a core forked by the fork server (server.engine.core.fork_server) is the fork server's
child, and one the fork server outlived is re-parented. A pidfd names the process itself (no pid
reuse); where the kernel has none (before Linux 5.3), signal 0 says whether the pid still exists.
"""
from __future__ import annotations

import contextlib
import os
import select


class FrontEndWatch:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = -1
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)

    def gone(self) -> bool:
        if self._pidfd >= 0:  # readable once the process has exited
            return bool(select.select([self._pidfd], [], [], 0)[0])
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
