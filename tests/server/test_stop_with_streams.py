"""Issue 42: Ctrl-C with streams in flight. Past --shutdown-timeout (or at a second Ctrl-C) uvicorn
cancels the running requests; the stop says how many in one line, with no traceback (CancelledError,
KeyboardInterrupt, a grammar worker's BrokenPipeError) and exit status 0. The banner states the real
--shutdown-timeout."""
from __future__ import annotations

import re
import signal
import threading
import time

import httpx

from server.embedded_redis.server import free_port
from tests.server.test_cli_start_stop import NOISE, _start, _stop


def _streams_in_flight(port: int, banner: str, count: int) -> tuple[list[threading.Thread], list[str]]:
    key = re.search(r"demo tenant API key \(kept in \S+\): (\S+)", banner).group(1)
    model = re.search(r"loraplex is serving (\S+) at", banner).group(1)
    lines: list[str] = []

    def stream() -> None:
        body = {"model": model, "prompt": "hi", "max_tokens": 240, "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                lines.extend(r.iter_lines())
        except httpx.HTTPError as e:  # cut by the stop: what the client sees is the test's business
            lines.append(repr(e))

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(lines) < count:  # every stream has sent a chunk
        assert time.monotonic() < deadline, lines[-3:]
        time.sleep(0.02)
    return threads, lines


def test_sigint_with_streams_in_flight_prints_no_traceback(tmp_path):
    port = free_port()
    proc, out, err = _start(tmp_path, port, "--shutdown-timeout", "0.5")
    assert "stop: Ctrl-C (or SIGTERM): running requests get 0.5 s to finish" in out.read_text()
    threads, _ = _streams_in_flight(port, out.read_text(), 12)
    assert _stop(proc, signal.SIGINT) == 0
    for t in threads:
        t.join(30)
    text = err.read_text(errors="replace")
    assert "SIGINT received: stopping (running requests get 0.5 s;" in text, text
    assert not NOISE.search(text) and "KeyboardInterrupt" not in text and "CancelledError" not in text, text
    assert re.search(r"loraplex: \d+ running request\(s\) cut at the stop", text), text


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    port = free_port()
    proc, out, err = _start(tmp_path, port)
    assert "running requests get 30 s to finish" in out.read_text()  # the default --shutdown-timeout
    threads, _ = _streams_in_flight(port, out.read_text(), 12)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert _stop(proc, signal.SIGINT) == 0
    for t in threads:
        t.join(30)
    text = err.read_text(errors="replace")
    assert not NOISE.search(text) and "KeyboardInterrupt" not in text and "CancelledError" not in text, text
