"""The engine core refuses what a front end should never send: a message over its size bound is
dropped by ZMQ before it is read (the core's memory does not grow by it), a malformed one (not msgpack,
not a known message, failing its checks, several frames) is counted and dropped, and the core goes on
serving its real front end."""
from __future__ import annotations

import time

import msgspec
import psutil
import pytest
import zmq

from tests.remote_core import greedy_ids, tiny_core

LIMIT = 1 << 20


@pytest.fixture
def core(tiny_model_dir, redis_url, core_starter):
    client = tiny_core(tiny_model_dir, redis_url, "lp-bounds:", core_starter, max_message_bytes=LIMIT)
    try:
        yield client
    finally:
        client.shutdown()


def _wait(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_malformed_and_oversized_messages_are_refused_and_the_core_serves_on(core):
    expected = greedy_ids(core, "before")
    rss = psutil.Process(core.core_pid).memory_info().rss
    ctx = zmq.Context()
    intruder = ctx.socket(zmq.DEALER)
    intruder.setsockopt(zmq.LINGER, 0)
    intruder.connect(core.input_address)
    try:
        malformed = [
            [b"\xc1 not msgpack"],
            [msgspec.msgpack.encode({"type": "nonsense"})],
            [msgspec.msgpack.encode({"type": "submit", "request_id": 3})],
            # Well formed, but its params fail SamplingParams' own checks (decoded with __post_init__).
            [msgspec.msgpack.encode({"type": "submit", "request_id": "x", "prompt_ids": b"", "params": {"top_p": 7},
                                     "version_id": None, "tenant": None, "priority": 0, "tenant_weight": None,
                                     "cache_salt": None, "grammar_json": None})],
            [msgspec.msgpack.encode({"type": "abort", "request_ids": ["a"]}), b"a second frame"],
            [msgspec.msgpack.encode({"type": "command", "call_id": 1, "op": "rm -rf"})],
            # A small message claiming a huge array: msgspec checks the length against the bytes there.
            [b"\x81\xa4type\xa5abort\xabrequest_ids\xdd\x7f\xff\xff\xff"],
        ]
        for frames in malformed:
            intruder.send_multipart(frames)
        _wait(lambda: core.refused_messages >= len(malformed))
        assert core.refused_messages == len(malformed)
        for _ in range(4):  # 4 x 16 MiB, over the 1 MiB bound: never read into the core's memory
            intruder.send(b"\0" * (16 << 20))
        time.sleep(1.0)
    finally:
        ctx.destroy(linger=0)
    assert psutil.Process(core.core_pid).memory_info().rss - rss < 16 << 20
    assert core.is_healthy
    assert greedy_ids(core, "after") == expected
