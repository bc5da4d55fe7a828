"""bench_cold_sources' victim client in a process of its own: it streams completions from a server and
hands back each one's start and token arrival times, for a set count or until its block ends."""
from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.serving.victim_stream import VictimProcess

TOKENS = 3


class _Completions(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for _ in range(TOKENS):
            self.wfile.write(b'data: {"choices": []}\n\n')
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_counted_victim_streams_that_many_completions(url):
    before = time.perf_counter()
    with VictimProcess(url, "key", "model", None, streams=2) as victim:
        pass
    assert len(victim.stamps) == 2 and all(len(s) == 1 + TOKENS for s in victim.stamps)
    flat = [t for s in victim.stamps for t in s]
    assert flat == sorted(flat) and before < flat[0] < time.perf_counter()  # one clock with this process's


def test_an_open_victim_streams_until_its_block_ends(url):
    with VictimProcess(url, "key", "model", None) as victim:
        time.sleep(1.5)
    assert len(victim.stamps) >= 2 and all(len(s) == 1 + TOKENS for s in victim.stamps)
