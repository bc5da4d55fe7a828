"""benchmarks/serving/bench.py's peer mode and thread fairness: argument handling, the vLLM command and
environment it would build, and the thread count and load averages the JSON records. The vLLM
run itself is not in CI (docs/benchmarks/cpu-vs-vllm.md)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.peers.peer import (PeerConfigError, VllmPeerConfig, check_peer_arguments, core_list,
                                   find_preloads, peer_config, python_executable)
from benchmarks.serving import bench
from server.bench.report import format_table
from server.bench.model_setup import serve_args as _serve_args
from server.bench.runner import BenchConfig, BenchConfigError, run_bench


@pytest.fixture(scope="module")
def bench_script():
    return bench


@pytest.fixture
def peer_env(tmp_path) -> Path:
    root = tmp_path / "vllm-venv"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("#!/bin/sh\n")
    lib = root / "lib" / "python3.11" / "site-packages" / "intel_openmp" / "lib"
    lib.mkdir(parents=True)
    (lib / "libiomp5.so").write_bytes(b"")
    return root


def test_core_lists_use_ranges():
    assert core_list([1, 0]) == "0-1"
    assert core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert core_list([3]) == "3"


def test_peer_python_is_a_venv_root_or_its_python(peer_env, tmp_path):
    assert python_executable(peer_env) == peer_env / "bin" / "python"
    assert python_executable(peer_env / "bin" / "python") == peer_env / "bin" / "python"
    with pytest.raises(PeerConfigError, match="--peer-python"):
        python_executable(tmp_path / "nowhere")


def test_preloads_come_from_the_peer_env_then_the_system(peer_env, tmp_path):
    system = tmp_path / "syslib"
    system.mkdir()
    (system / "libjemalloc.so.2").write_bytes(b"")
    found = find_preloads(peer_env, lib_dirs=(str(system),))
    assert found == [str(system / "libjemalloc.so.2"),
                     str(peer_env / "lib/python3.11/site-packages/intel_openmp/lib/libiomp5.so")]
    assert find_preloads(tmp_path / "empty", lib_dirs=()) == []


def _parse(bench_script, *extra):
    return bench_script.build_parser().parse_args(list(extra))


def test_peer_arguments_are_checked_before_anything_runs(bench_script, peer_env):
    assert check_peer_arguments(_parse(bench_script)) is None
    assert check_peer_arguments(_parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env))) \
        == peer_env / "bin" / "python"
    with pytest.raises(PeerConfigError, match="needs --peer-python"):
        check_peer_arguments(_parse(bench_script, "--peer", "vllm"))
    with pytest.raises(PeerConfigError, match="needs --peer vllm"):
        check_peer_arguments(_parse(bench_script, "--peer-python", str(peer_env)))
    with pytest.raises(PeerConfigError, match="--device cpu"):
        check_peer_arguments(_parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env),
                                    "--device", "cuda"))
    with pytest.raises(PeerConfigError, match="mixed workload"):
        check_peer_arguments(_parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env),
                                    "--workload", "prefix"))
    with pytest.raises(SystemExit):
        _parse(bench_script, "--peer", "sglang")


def test_a_missing_peer_env_fails_fast_with_exit_2(bench_script, tmp_path, capsys):
    rc = bench_script.main(["--peer", "vllm", "--peer-python", str(tmp_path / "nope"),
                            "--json", str(tmp_path / "out.json"), "--work-dir", str(tmp_path)])
    assert rc == 2
    assert "--peer-python" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
    assert bench_script.main(["--model-shape", "smol135", "--model", str(tmp_path), "--work-dir", str(tmp_path)]) == 2


def test_command_and_env_match_loraplex_settings(bench_script, peer_env, tiny_model_dir, tmp_path):
    args = _parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env), "--peer-kv-gib", "2",
                  "--cpu-threads", "2", "--rank", "16", "--max-num-seqs", "64")
    python = check_peer_arguments(args)
    cfg = BenchConfig(model_dir=str(tiny_model_dir), cpu_threads=args.cpu_threads, ranks=(16,), max_num_seqs=64,
                      work_dir=str(tmp_path))
    adapters = {"lora-0000": tmp_path / "a0", "lora-0003": tmp_path / "a3"}
    pcfg = peer_config(cfg, args, python, tiny_model_dir, adapters, affinity=frozenset({4, 5, 6, 7}))
    argv = pcfg.command()
    assert argv[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--model", str(tiny_model_dir)), ("--max-loras", "2"), ("--max-lora-rank", "16"),
                        ("--max-model-len", "1024"), ("--dtype", "float32"), ("--max-num-seqs", "64"),
                        ("--port", "8001")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--enable-lora" in argv
    i = argv.index("--lora-modules")
    assert argv[i + 1:i + 3] == [f"lora-0000={tmp_path / 'a0'}", f"lora-0003={tmp_path / 'a3'}"]
    env = pcfg.env({"PATH": "/bin", "PYTHONPATH": "/work/main", "LD_PRELOAD": "/x.so"})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4-5"  # the first cores of the mask, one per thread
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin"
    assert env["LD_PRELOAD"].split(":")[-1] == "/x.so" and "libiomp5.so" in env["LD_PRELOAD"]


def test_relative_directories_reach_the_peer_absolute(bench_script, peer_env, tiny_model_dir, tmp_path, monkeypatch):
    """vLLM takes a relative model directory for a hub repo id (and fails offline)."""
    monkeypatch.chdir(tiny_model_dir.parent)
    args = _parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env))
    cfg = BenchConfig(model_dir=tiny_model_dir.name, cpu_threads=1, work_dir=str(tmp_path))
    pcfg = peer_config(cfg, args, check_peer_arguments(args), Path(tiny_model_dir.name),
                       {"lora-0000": Path("a0")}, affinity=frozenset({0}))
    argv = pcfg.command()
    assert argv[argv.index("--model") + 1] == str(tiny_model_dir.resolve())
    assert argv[argv.index("--lora-modules") + 1] == f"lora-0000={tiny_model_dir.parent.resolve() / 'a0'}"


def test_peer_config_refuses_more_threads_than_cores(tmp_path):
    with pytest.raises(PeerConfigError):
        VllmPeerConfig(python=tmp_path, model_dir=tmp_path, adapters=(), max_loras=1, max_lora_rank=8,
                       max_model_len=64, dtype="float32", threads=3, cores=(0, 1))


def test_loraplex_gets_the_peers_kv_pool(tiny_model_dir):
    """With --peer, loraplex's KV pool is the peer's size in whole blocks of this model: a smaller pool
    preempts sooner, which would make the comparison unfair."""
    from server.bench.model_setup import kv_cache_blocks
    from server.engine.config import ModelConfig
    from server.engine.kv_cache import kv_bytes_per_block

    cfg = BenchConfig(kv_cache_bytes=1 << 30)
    per_block = kv_bytes_per_block(ModelConfig.from_dir(tiny_model_dir), 16, torch.float32)
    blocks = kv_cache_blocks(cfg, tiny_model_dir)
    assert blocks == (1 << 30) // per_block and blocks * per_block <= 1 << 30 < (blocks + 1) * per_block
    args = _serve_args(cfg, 2, blocks)
    assert args[args.index("--kv-cache-blocks") + 1] == str(blocks)
    assert kv_cache_blocks(BenchConfig(), tiny_model_dir) is None
    assert "--kv-cache-blocks" not in _serve_args(BenchConfig(), 2)
    with pytest.raises(BenchConfigError, match="KV pool"):
        BenchConfig(kv_cache_bytes=0)


def test_bench_threads_are_validated_and_reach_the_server(tiny_model_dir):
    assert "--cpu-threads" in _serve_args(BenchConfig(cpu_threads=3), 4)
    assert _serve_args(BenchConfig(cpu_threads="3"), 4)[-2:] == ["--cpu-threads", "3"]
    assert BenchConfig().threads() >= 1
    for bad in ("zero", 0, None):
        with pytest.raises(BenchConfigError, match="--cpu-threads"):
            BenchConfig(cpu_threads=bad)


def test_both_sides_get_the_same_threads_and_the_json_records_load(tiny_model_dir, tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = BenchConfig(adapter_counts=(2,), num_requests=3, prompt_len=(4, 6), output_len=(2, 3), target="engine",
                          compare_peft=True, model_dir=str(tiny_model_dir), cpu_threads=1, work_dir=str(tmp_path))
        doc = run_bench(cfg, None, log=lambda m: None)
        assert torch.get_num_threads() == 1  # the baseline, run last, was held to the same count
    finally:
        torch.set_num_threads(before)
    point = doc["points"][0]
    assert doc["environment"]["cpu_threads"] == 1 and point["cpu_threads"] == 1
    for side in ("loraplex", "baseline"):
        for when in ("before", "after"):
            assert len(point["load_avg"][side][when]) == 3
    point["peer"] = point["loraplex"]
    point["throughput_ratio_vs_peer"], point["ttft_p50_ratio_peer_over_loraplex"] = 1.25, 0.5
    table = format_table({**doc, "peer": {"name": "vllm"}})
    assert "vllm" in table and "loraplex/vllm x1.25" in table


def test_affinity_is_what_auto_counts():
    assert BenchConfig(cpu_threads="auto").threads() == max(1, len(os.sched_getaffinity(0)) - 1)


FAKE_SERVER = '''
import argparse, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

p = argparse.ArgumentParser()
p.add_argument("-m"); p.add_argument("--port", type=int); p.add_argument("--lora-modules", nargs="*", default=[])
args, _ = p.parse_known_args()
names = {"base", *(m.split("=")[0] for m in args.lora_modules)}

async def models(request):
    return JSONResponse({"data": [{"id": n} for n in sorted(names)]})

async def completions(request):
    body = await request.json()
    if body["model"] not in names:
        return JSONResponse({"error": {"message": "unknown model"}}, status_code=404)
    def chunks():
        for i in range(body["max_tokens"]):
            yield "data: " + json.dumps({"choices": [{"text": "x"}], "usage": None}) + "\\n\\n"
        usage = {"completion_tokens": body["max_tokens"]}
        yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\\n\\n" + "data: [DONE]\\n\\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
'''


def test_the_peer_runs_each_point_right_after_loraplex_every_round(bench_script, tiny_model_dir, tmp_path):
    """A stand-in for vLLM's server (same flags, same OpenAI streaming) run through the real path, beside
    the in-process engine, two rounds of a two-point sweep: ratios are paired within rounds."""
    import sys
    import statistics

    from benchmarks.peers.peer import peer_runner
    from server.bench.server_proc import free_port

    (tmp_path / "fake_vllm.py").write_text(FAKE_SERVER)
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo 0.0-fake; exit 0; fi\n'
                      f'exec {sys.executable} {tmp_path / "fake_vllm.py"} "$@"\n')
    python.chmod(0o755)
    args = _parse(bench_script, "--peer", "vllm", "--peer-python", str(python.parent.parent), "--cpu-threads", "1",
                  "--peer-port", str(free_port()), "--peer-preload", "none")
    cfg = BenchConfig(adapter_counts=(1, 3), num_requests=4, prompt_len=(4, 6), output_len=(2, 3),
                      model_dir=str(tiny_model_dir), target="engine", cpu_threads=1, repeats=2,
                      work_dir=str(tmp_path / "work"))
    meta, run_peer = peer_runner(cfg, args, check_peer_arguments(args), tiny_model_dir, log=lambda m: None)
    order = []
    doc = run_bench(cfg, None, log=order.append, after_point=run_peer)
    assert [m for m in order if m.startswith("round")] == ["round 1/2: adapters 1, 3", "round 2/2: adapters 3, 1"]
    assert meta["version"] == "0.0-fake" and meta["threads"] == 1
    assert [p["num_adapters"] for p in doc["points"]] == [1, 3]
    for point in doc["points"]:
        assert point["peer"]["completed"] == 4 == point["peer"]["requests"]
        assert len(point["rounds"]) == 2 and all(r["peer_tok_s"] > 0 < r["loraplex_tok_s"] for r in point["rounds"])
        paired = [r["loraplex_tok_s"] / r["peer_tok_s"] for r in point["rounds"]]
        assert point["throughput_ratio_vs_peer"] == pytest.approx(statistics.median(paired))
        assert set(point["load_avg"]["peer"]) == {"before", "after"}
    by_round = [p["rounds"] for p in doc["points"]]
    want = statistics.median(b["loraplex_tok_s"] / a["loraplex_tok_s"] for a, b in zip(*by_round))
    assert doc["throughput_vs_fewest_adapters"] == {"3": pytest.approx(want)}


def test_peer_quantization_options_are_checked_before_anything_runs(bench_script, peer_env):
    peer = ("--peer", "vllm", "--peer-python", str(peer_env))
    assert check_peer_arguments(_parse(bench_script, *peer, "--peer-quantization", "w8a8-int8",
                                       "--quantization", "int8")) == peer_env / "bin" / "python"
    with pytest.raises(PeerConfigError, match="need --peer vllm"):
        check_peer_arguments(_parse(bench_script, "--peer-quantization", "w8a16-int8", "--quantization", "int8"))
    with pytest.raises(PeerConfigError, match="need --peer vllm"):
        check_peer_arguments(_parse(bench_script, "--peer-patch", "lora-device"))
    with pytest.raises(PeerConfigError, match="--quantization int8"):  # the peer would serve other weights
        check_peer_arguments(_parse(bench_script, *peer, "--peer-quantization", "w8a8-int8"))
    with pytest.raises(PeerConfigError, match="--quantization int8"):
        check_peer_arguments(_parse(bench_script, *peer, "--peer-quantization", "w8a8-int8",
                                    "--quantization", "none,int8"))
    with pytest.raises(SystemExit):  # GPTQ goes in as --model, served as is by both sides
        _parse(bench_script, *peer, "--peer-quantization", "gptq-4bit")


def test_the_peer_serves_the_int8_copy_with_the_shim_on_its_path(bench_script, peer_env, tiny_model_dir, tmp_path):
    import json

    from benchmarks.peers.peer_quantization import peer_model_dir

    args = _parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env), "--quantization", "int8",
                  "--peer-quantization", "w8a16-int8", "--peer-patch", "lora-device", "--cpu-threads", "1")
    python = check_peer_arguments(args)
    served = peer_model_dir(args, tiny_model_dir, tmp_path, log=lambda m: None)
    assert served == (tmp_path / "models" / f"{tiny_model_dir.name}-w8a16-int8").resolve()
    assert json.loads((served / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    cfg = BenchConfig(model_dir=str(tiny_model_dir), cpu_threads=1, work_dir=str(tmp_path), quantization=("int8",))
    pcfg = peer_config(cfg, args, python, tiny_model_dir, {"lora-0000": tmp_path / "a0"},
                       affinity=frozenset({0}), served_dir=served)
    argv = pcfg.command()
    assert argv[argv.index("--model") + 1] == str(served)
    shim = Path(pcfg.env({"PYTHONPATH": "/work/main"})["PYTHONPATH"])  # the shim only, never the caller's path
    assert (shim / "sitecustomize.py").is_file() and "_get_lora_device" in (shim / "sitecustomize.py").read_text()
    plain = _parse(bench_script, "--peer", "vllm", "--peer-python", str(peer_env))
    assert peer_model_dir(plain, tiny_model_dir, tmp_path, log=lambda m: None) == tiny_model_dir
    assert "PYTHONPATH" not in peer_config(cfg, plain, python, tiny_model_dir, {}, affinity=frozenset({0})).env({})


def test_with_int8_the_peft_oracle_runs_on_the_dequantized_weights(tiny_model_dir, tmp_path):
    """--quantization int8 --compare-peft: transformers + peft on dequantize(quantize(w)), so loraplex's greedy
    tokens are held to exactness against the weights it serves."""
    cfg = BenchConfig(adapter_counts=(2,), num_requests=6, prompt_len=(4, 8), output_len=(6, 8),
                      model_dir=str(tiny_model_dir), target="engine", compare_peft=True, cpu_threads=1,
                      quantization=("int8",), work_dir=str(tmp_path))
    point = run_bench(cfg, None, log=lambda m: None)["points"][0]
    assert point["baseline_weights"] == "int8-dequantized"
    assert point["token_ids_vs_peft"] == {"compared": 6, "same": 6, "mismatches": []}
    assert (tmp_path / "models" / f"{tiny_model_dir.name}-int8-reference" / "config.json").is_file()
