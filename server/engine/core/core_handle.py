"""CoreHandle: an engine-core process as much of subprocess.Popen as the engine clients use (pid, poll,
wait, kill, returncode: negative for the signal that ended it), for cores that are forks, not Popens."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

POLL_S = 0.05


class CoreHandle:
    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        # Polled, not blocking: the engine client's watch thread and its shutdown both wait.
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout)
            time.sleep(POLL_S)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
