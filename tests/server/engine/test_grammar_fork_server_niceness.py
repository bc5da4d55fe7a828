"""The grammar compile pool's fork server runs at COMPILE_NICENESS from its first instant: it imports
xgrammar and torch (seconds of CPU, right after the server is ready), and at the server's priority
those imports took the core from requests (seen as the abuse bench's baseline phase running ~7 s
of fork-server imports). The server's own threads keep their priority. A fresh interpreter, since
the fork server is one per process: a real GrammarCompileService, a real fork server."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from server.engine.grammar_worker import COMPILE_NICENESS

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import psutil
    from transformers import AutoTokenizer
    from server.engine.grammar import Grammars
    from server.engine.grammar_worker import GrammarCompileService

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    service = GrammarCompileService(Grammars(tok, 512, [tok.eos_token_id]), timeout_ms=5000)
    service.prestart()
    deadline = time.monotonic() + 60
    fork = None
    while fork is None and time.monotonic() < deadline:
        fork = next((c for c in psutil.Process().children()
                     if "multiprocessing.forkserver" in " ".join(c.cmdline())), None)
        time.sleep(0.01)
    print(json.dumps({"fork_server": fork and fork.nice(), "main": os.getpriority(os.PRIO_PROCESS, 0)}))
    sys.stdout.flush()
    os._exit(0)  # the fork server ends with us (its pipe closes), mid-import or not
""")


@pytest.mark.skipif(sys.platform != "linux", reason="niceness per thread is Linux's")
def test_the_fork_server_imports_at_the_compile_niceness_and_the_server_keeps_its_own(tiny_model_dir):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["fork_server"] == COMPILE_NICENESS, seen
    assert seen["main"] == 0, seen
