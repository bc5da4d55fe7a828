#!/usr/bin/env python3
"""A new user's first start, timed: clone the repository, run its `scripts/serve` with a fresh data
dir and no .venv (so the install, the default model's wheel and its conversion are all in the time),
until the ready line; stop it, start it again (everything now in place), and run the curl line the
banner prints.

    python3 -m benchmarks.serving.bench_first_start --repo . --json docs/benchmarks/first-start-cpu.json

With --second-only and the --workdir of an earlier --keep run, the kept clone is brought to the repo's
checked-out commit (git pull) and only the second start is timed, against the kept .venv and data dir.

Every `loraplex...` line of both starts is kept with its time since the start, so the JSON says where
the time went (pip's steps, the wheel, the conversion, the engine's start-up). Only the standard
library: the clone's own install is part of what is measured. Leaves nothing running; the clone is
deleted unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

READY = re.compile(r"^loraplex is serving (\S+) at (\S+)")
ENGLISH = re.compile(r"^[A-Z][A-Za-z0-9 ,'()-]*[a-z][A-Za-z0-9 ,'()-]*[.!?]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Start:
    """One `scripts/serve` child: its output drained to a log (timestamped), the lines that matter kept."""

    def __init__(self, clone: Path, data_dir: Path, port: int, log: Path):
        env = {**os.environ, "LORAPLEX_DATA_DIR": str(data_dir)}
        env.pop("VIRTUAL_ENV", None)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(["scripts/serve", "--host", "127.0.0.1", "--port", str(port)], cwd=clone,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.events: list[dict] = [{"t": 0.0, "line": "(scripts/serve started)"}]
        self._log = log.open("a", encoding="utf-8")
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for raw in self.proc.stdout:
            t = time.monotonic() - self.started
            line = raw.rstrip("\n").split("\r")[-1]
            self._log.write(f"{t:8.2f} {line}\n")
            self._log.flush()
            self.lines.put((t, line))
        self.lines.put((time.monotonic() - self.started, None))

    def until_ready(self, timeout_s: float) -> dict:
        """Seconds to the ready line, the model and URL, the demo curl line; raises if it never comes."""
        deadline = self.started + timeout_s
        ready, out = None, {}
        while True:
            try:
                t, line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no ready line in {timeout_s:.0f} s") from None
            if line is None:
                raise RuntimeError(f"scripts/serve exited with {self.proc.wait()} before it was ready")
            if line.startswith("loraplex"):
                self.events.append({"t": round(t, 2), "line": line})
            m = READY.match(line)
            if m:
                ready = t
                out = {"ready_s": round(t, 2), "model": m.group(1), "url": m.group(2)}
            elif ready is not None and line.strip().startswith("curl "):
                out["curl"] = line.strip()
            elif ready is not None and line.startswith("stop:"):
                return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=5)
        self._log.close()
        return self.proc.returncode


def phases(events: list[dict], ready_s: float) -> list[dict]:
    """Each `loraplex...` line up to the ready one, with the seconds until the next: where the time went."""
    until = [e for e in events if e["t"] <= ready_s]
    return [{"phase": e["line"][:120], "s": round(nxt["t"] - e["t"], 2)} for e, nxt in zip(until, until[1:])]


def first_curl(line: str) -> dict:
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    try:
        content = json.loads(done.stdout)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        content = None
    return {"seconds": round(seconds, 2), "content": content, "raw": None if content else done.stdout[:2000],
            "english_sentence": bool(content and ENGLISH.match(content.strip()))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo", default=".", help="the repository to clone, its checked-out branch (default .)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the clone and its data dir go (default: a new temporary directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for each ready line (default 900)")
    p.add_argument("--json", type=Path, default=Path("bench-out/first-start.json"),
                   help="where to write the JSON (default bench-out/first-start.json)")
    p.add_argument("--keep", action="store_true", help="keep the clone and its data dir (default: deleted)")
    p.add_argument("--second-only", action="store_true",
                   help="time only the second start, in the clone an earlier --keep run left in --workdir, "
                        "pulled to the repo's commit (default: clone afresh, time both starts)")
    args = p.parse_args(argv)
    if args.second_only and (args.workdir is None or not (args.workdir / "clone" / ".git").is_dir()):
        p.error("--second-only needs the --workdir of an earlier --keep run")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="loraplex-first-start-"))
    clone, data_dir, log = work / "clone", work / "data", args.json.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    doc: dict = {"load_avg_start": os.getloadavg(), "cpu_count": os.cpu_count(),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        if args.second_only:
            subprocess.run(["git", "-C", str(clone), "pull", "-q", "--ff-only", str(Path(args.repo).resolve()), "HEAD"],
                           check=True)
        else:
            subprocess.run(["git", "clone", "-q", str(args.repo), str(clone)], check=True)
        doc["commit"] = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True,
                                       text=True, check=True).stdout.strip()
        for which in ("second",) if args.second_only else ("first", "second"):
            print(f"{which} start ...", file=sys.stderr, flush=True)
            start = Start(clone, data_dir, free_port(), log)
            try:
                doc[which] = start.until_ready(args.timeout)
                doc[which]["events"] = start.events
                doc[which]["phases"] = phases(start.events, doc[which]["ready_s"])
                doc[which]["load_avg_ready"] = os.getloadavg()
                print(f"{which} start: ready in {doc[which]['ready_s']:.1f} s", file=sys.stderr, flush=True)
                if which == "second":
                    doc["curl"] = first_curl(doc[which]["curl"])
                    print(f"first curl: {doc['curl']['content']!r}", file=sys.stderr, flush=True)
            finally:
                doc.setdefault(which, {})["exit_code"] = start.stop()
    finally:
        doc["load_avg_end"] = os.getloadavg()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        if not (args.keep or args.second_only):
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.json} (output of both starts: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
