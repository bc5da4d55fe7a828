"""benchmarks/serving/bench_first_start.py's reading of a start (where the time went), and the CPU engine's
import path staying clear of triton (a first start no longer imports it)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import triton

from benchmarks.serving.bench_first_start import ENGLISH, main, phases
from tests.repo import ROOT_DIR as ROOT



def test_phases_are_the_seconds_between_progress_lines_up_to_ready() -> None:
    events = [{"t": 0.0, "line": "(scripts/serve started)"}, {"t": 20.5, "line": "loraplex install: [2/3] torch"},
              {"t": 71.0, "line": "loraplex: converting x.gguf"}, {"t": 80.25, "line": "loraplex is serving m at u"},
              {"t": 99.0, "line": "loraplex: SIGTERM received"}]
    assert phases(events, ready_s=80.25) == [
        {"phase": "(scripts/serve started)", "s": 20.5}, {"phase": "loraplex install: [2/3] torch", "s": 50.5},
        {"phase": "loraplex: converting x.gguf", "s": 9.25}]


def test_a_sentence_is_told_from_json_and_fragments() -> None:
    assert ENGLISH.match("The capital of France is Paris.")
    for reply in ('{"answer": "Paris"}', "paris.", "Paris", "<|im_end|>", "\u00e9t\u00e9."):
        assert not ENGLISH.match(reply), reply


@pytest.mark.parametrize("extra", [[], ["--workdir", "WORK"]])
def test_second_only_needs_the_workdir_of_a_kept_run(tmp_path, capsys, extra) -> None:
    argv = ["--second-only", "--json", str(tmp_path / "out.json"), *[str(tmp_path) if a == "WORK" else a for a in extra]]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "--second-only needs the --workdir of an earlier --keep run" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_lora_tiles_widths_equal_tritons_without_importing_it() -> None:
    from kernels.lora_tiles import _next_power_of_2

    assert [_next_power_of_2(n) for n in range(1, 4097)] == [triton.next_power_of_2(n) for n in range(1, 4097)]
    done = subprocess.run([sys.executable, "-c", "import sys; import server.engine.llm_engine, server.api.app; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
