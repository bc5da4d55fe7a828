"""Issue 35, item 1: the engine core's step loop only reads and writes in-memory queues; the socket
threads do every (de)serialisation. Checked on the source: server/engine/core/busy_loop.py and the
items it exchanges (queue_items.py) import neither ZMQ nor a codec, so no message can be encoded or
decoded on the loop's thread. The loop end to end: tests/server/api/test_api_engine_process.py."""
from __future__ import annotations

import ast

import pytest

from tests.repo import ROOT_DIR

pytestmark = pytest.mark.unit

CORE = ROOT_DIR / "server" / "engine" / "core"
SERIALISING = ("zmq", "msgspec", "pickle", "json")


def _imports(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


@pytest.mark.parametrize("name", ["busy_loop.py", "queue_items.py"])
def test_the_step_loop_side_imports_no_socket_or_codec(name):
    bad = {m for m in _imports(CORE / name) if m.split(".")[0] in SERIALISING}
    assert not bad, f"{name} imports {sorted(bad)}"
