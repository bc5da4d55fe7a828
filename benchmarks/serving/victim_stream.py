"""The victim tenant's client in a process of its own (bench_cold_sources): it streams 32-token greedy
completions one after another and keeps each one's token arrival times, so its clock is read by a
process that shares no interpreter lock with the storm's 32 client threads and moto (in the bench's own
process the victim's thread waited for them, and its gaps counted that wait as the server's).

    python -m benchmarks.serving.victim_stream URL KEY MODEL CORE STREAMS

CORE: the core to run on (-1: any); STREAMS: how many completions (0: until stdin closes). Prints one JSON
line: a list per completion of [its start, then the arrival time of every token] (time.perf_counter,
the system-wide monotonic clock, comparable with the bench's own readings)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from benchmarks.profile.cpu_pinning import pin_thread

TOKENS = 32


def stream(url: str, key: str, model: str, max_tokens: int) -> tuple[float, list[float]]:
    """(time to first token, [its start, then the arrival time of every token]) of one streamed completion."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps = [start]
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return stamps[1] - start, stamps


def _main(url: str, key: str, model: str, core: int, streams: int) -> None:
    pin_thread(core if core >= 0 else None)
    stop = threading.Event()
    if streams == 0:
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stamps: list[list[float]] = []
    while not stop.is_set() and (streams == 0 or len(stamps) < streams):
        try:
            stamps.append(stream(url, key, model, TOKENS)[1])
        except httpx.HTTPStatusError:  # a 503 (Redis timed out on a loaded machine): the next stream
            continue
    print(json.dumps(stamps))


@dataclass
class VictimProcess:
    """`with VictimProcess(...) as v:` streams in a child process until the block ends (or `streams` are
    done); v.stamps then holds what it recorded."""
    url: str
    key: str
    model: str
    core: int | None
    streams: int = 0  # 0: until the block ends

    def __post_init__(self) -> None:
        self.stamps: list[list[float]] = []
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> "VictimProcess":
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.serving.victim_stream", self.url, self.key, self.model,
             str(-1 if self.core is None else self.core), str(self.streams)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        out, _ = self._proc.communicate()  # closes its stdin: a streams=0 victim ends its current stream, then stops
        if self._proc.returncode != 0:
            raise RuntimeError(f"the victim's client exited with {self._proc.returncode}")
        self.stamps = json.loads(out)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
