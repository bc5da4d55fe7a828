"""The supervisor's thread sleeps while its child runs, and still sees it exit and a stop at once."""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from server.embedded_redis.supervisor import Supervisor


def _voluntary_switches(tid: int) -> int:
    """How often thread `tid` of this process has gone to sleep so far."""
    for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def test_supervisor_sleeps_until_the_child_exits_then_restarts_it_and_stops() -> None:
    children = [subprocess.Popen(["sleep", "60"])]
    respawned = threading.Event()

    def respawn() -> None:
        children.append(subprocess.Popen(["sleep", "60"]))
        respawned.set()

    sup = Supervisor("sleeper", lambda: children[-1], respawn, initial_delay=0.01)
    sup.start()
    try:
        thread = next(t for t in threading.enumerate() if t.name == "supervise-sleeper")
        time.sleep(0.2)  # in its wait by now
        before = _voluntary_switches(thread.native_id)
        time.sleep(1.0)
        # A poll with Popen.wait(timeout) wakes ~90 times in a second (sleeps doubling up to 50 ms), each
        # time taking the GIL from the server's engine thread; a wait in the kernel does not wake at all.
        assert _voluntary_switches(thread.native_id) - before <= 2
        children[0].kill()
        assert respawned.wait(10), "the child's exit was not noticed"
        assert sup.restarts == 1 and len(children) == 2
    finally:
        stopper = threading.Thread(target=sup.stop)
        stopper.start()
        stopper.join(10)
        for child in children:
            child.kill()
            child.wait()
    assert not stopper.is_alive() and not thread.is_alive(), "stop() did not wake the waiting thread"
    sup.stop()  # a second stop is harmless
