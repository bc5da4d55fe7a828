"""Supervisor: a daemon thread that restarts a child process that exits unasked.

It knows nothing about Redis: it watches whatever `current()` returns and calls
`respawn()` to replace it. Restarts back off (doubling up to a cap) so a child
that dies at once (bad config, port taken, disk full) is not relaunched in a
tight loop; the delay resets once a child has stayed up for `stable_after` s.

The thread sleeps in the kernel until the child exits or stop() is called (a pidfd and a wake-up pipe
under select): it never wakes while the child runs. Popen.wait(timeout) polls instead, waking up to
~100 times a second, and every wake-up takes the GIL from the engine thread of the server it sits in.
"""
from __future__ import annotations

import logging
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class SpawnError(RuntimeError):
    """A child could not be started; the supervisor retries after its backoff."""


class Supervisor:
    def __init__(self, name: str, current: Callable[[], subprocess.Popen],
                 respawn: Callable[[], None], *, initial_delay: float = 0.1,
                 max_delay: float = 5.0, stable_after: float = 10.0) -> None:
        self._name = name
        self._current = current
        self._respawn = respawn
        self._initial_delay = initial_delay
        self._max_delay = max_delay
        self._stable_after = stable_after
        self._stopping = threading.Event()
        # Set while the child is running and ready; cleared when it is known gone.
        self._up = threading.Event()
        self._resumed = threading.Condition()
        self._paused = False
        self._restarts = 0
        self._wake_r, self._wake_w = os.pipe()  # stop() writes a byte: _wait_exit's select returns
        self._wake_lock = threading.Lock()  # stop() against itself: the pipe is written and closed once
        self._thread = threading.Thread(target=self._run, name=f"supervise-{name}", daemon=True)

    @property
    def restarts(self) -> int:
        """Replacement children launched so far (failed launches included)."""
        return self._restarts

    @property
    def stopping(self) -> threading.Event:
        """Set by stop(); a respawn in progress should give up when it is set."""
        return self._stopping

    def start(self) -> None:
        self._up.set()
        self._thread.start()

    def stop(self) -> None:
        """End supervision; the caller then stops the child itself."""
        self._stopping.set()
        with self._wake_lock:
            if self._wake_w >= 0:
                os.write(self._wake_w, b"x")
        with self._resumed:
            self._resumed.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        with self._wake_lock:  # _wait_exit selects only while not stopping, so no one reads them now
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def mark_down(self) -> None:
        """The child is about to be killed on purpose: wait_until_up() must not
        return before the supervisor has replaced it."""
        self._up.clear()

    def wait_until_up(self, timeout: float) -> bool:
        return self._up.wait(timeout)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """While inside, a child that dies stays dead; on leaving, it is restarted."""
        with self._resumed:
            self._paused = True
        try:
            yield
        finally:
            with self._resumed:
                self._paused = False
                self._resumed.notify_all()

    def _run(self) -> None:
        delay = self._initial_delay
        launched_at = time.monotonic()
        while True:
            proc = self._current()
            status = self._wait_exit(proc)
            if status is None:
                return
            self._up.clear()
            if time.monotonic() - launched_at >= self._stable_after:
                delay = self._initial_delay
            log.warning("%s (pid %d) exited with status %s; restarting in %.1f s",
                        self._name, proc.pid, status, delay)
            while True:
                if not self._wait_resumed() or self._stopping.wait(delay):
                    return
                delay = min(delay * 2, self._max_delay)
                self._restarts += 1
                launched_at = time.monotonic()
                try:
                    self._respawn()
                    break
                except SpawnError as e:
                    log.error("restart %d of %s failed, retrying in %.1f s: %s",
                              self._restarts, self._name, delay, e)
            if self._stopping.is_set():
                return
            self._up.set()
            log.warning("%s restarted (restart %d, pid %d)", self._name, self._restarts,
                        self._current().pid)

    def _wait_exit(self, proc: subprocess.Popen) -> int | None:
        """The child's exit status, or None once stop() was called."""
        if proc.returncode is not None:  # reaped already: its pid may belong to another process now
            return proc.returncode
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd (an old kernel), or the child was reaped already
            return self._poll_exit(proc)
        try:
            while not self._stopping.is_set():
                ready, _, _ = select.select([pidfd, self._wake_r], [], [])
                if pidfd in ready:
                    return proc.wait()  # exited: reaps it at once
            return None
        finally:
            os.close(pidfd)

    def _poll_exit(self, proc: subprocess.Popen) -> int | None:
        """_wait_exit where a pidfd cannot be had: polls."""
        while not self._stopping.is_set():
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
        return None

    def _wait_resumed(self) -> bool:
        """False if stop() was called while paused."""
        with self._resumed:
            while self._paused and not self._stopping.is_set():
                self._resumed.wait()
        return not self._stopping.is_set()
