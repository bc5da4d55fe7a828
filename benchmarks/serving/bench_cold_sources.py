"""Cold adapters from S3 (moto's S3 server on loopback): what the first request to a never-seen
adapter waits for (fetch, validation, first token), and what a storm of cold first uses does to
another tenant's inter-token latency, with the loads in the server process and in loader processes
side by side in one run. Prints a table and writes JSON.

Each arm is a fresh `loraplex serve` (its own Redis, so every adapter is cold). Where the machine
lets this process use two cores, they are split between the victim's core and the storm's core
(moto and the storm's clients always on the storm's), by `--placement`:

- `split` (the default; issue 35's layout, "engine core on its own core"): the server gets both cores
  and places itself with `--engine-cpus <victim core> --api-cpus <storm core>`: the engine-core process
  alone on the victim's core; its front end, Redis and loader processes on the storm's, with the victim's
  client (a client stands in for another machine).
- `server-core` (the layout before the engine core had a process of its own): the whole server (front
  end and engine core) and the victim's client on the victim's core; Redis and the loaders on the storm's.

The victim's client runs in a process of its own (benchmarks.serving.victim_stream), so its clock never
waits for the interpreter lock of this process, where moto and the storm's 32 client threads run.

    .venv/bin/python -m benchmarks.serving.bench_cold_sources [--model DIR] [--cold 100] [--rank 16] [--rounds 1]
        [--arms in-process,loaders] [--placement split|server-core] [--profile DIR] [--out F]

With `--profile DIR`, py-spy samples the server and its child processes through each phase (the
quiet baseline, the cold storm, the warm storm): raw stacks in DIR/<arm>-<round>/<phase>.txt, and the
server's CPU by category in the table and the JSON; the engine-core process's samples are named by
the part of its step loop (or its thread) they were in, and its threads' kernel times are listed apart.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import boto3
import httpx

from adapters.format import ModelShape, inspect_adapter_bytes, load_adapter_bytes
from adapters.sources import SourcePolicy, fetch_adapter, parse_reference
from benchmarks.profile import core_share, cpu_neighbours, thread_times
from benchmarks.profile.cpu_pinning import children, pin_process, pin_thread, pinned, two_cores
from benchmarks.profile.server_profile import Sampler, can_profile, profile_lines, summarize
from benchmarks.security.victim_harness import SETTLE_TIMEOUT_S, settle
from benchmarks.serving.victim_stream import VictimProcess, stream
from server.bench.metrics import percentile
from server.bench.server_proc import ServerProcess, free_port, provision
from server.bench.synth_adapters import ensure_adapters
from server.demo import ensure_demo

BUCKET = "bench"
VICTIM_START_S = 1.0  # the victim's client process starts and streams before the storm does
QUIET_STREAMS = 24  # ~740 gaps: a p99 of a few hundred is a handful of samples, and this machine is shared
# The arms: flags of `loraplex serve`. "in-process" is the path before loader processes, with its
# bound (4 fetches at once, no per-tenant bound); the others differ only in these flags.
ARMS = {
    "in-process": ["--adapter-load-workers", "0", "--adapter-loads-per-tenant", "4"],
    "loaders": [],  # the defaults: 2 loader processes, 1 fetch per tenant at once
    "loaders-2-per-tenant": ["--adapter-loads-per-tenant", "2"],
    # A storm step's prompt tokens capped at 32 while others decode (auto: 256 on a CPU): ~3 of the
    # storm's 11-token prompts, and their slot loads, per step instead of 8.
    "loaders-prefill-cap-32": ["--max-prefill-tokens-while-decoding", "32"],
}
PLACEMENTS = ("split", "server-core")  # see the module docstring


@dataclass(frozen=True)
class Placement:
    """Where one arm's parts run (cores as this process may use them)."""
    serve_flags: tuple[str, ...]  # the server's own placement flags
    server_cores: int | tuple[int, ...] | None  # the server process starts pinned here (None: not pinned)
    client_core: int | None  # the victim's client process
    pin_children_to: int | None  # Redis and the loader processes moved here once started (None: left)


def placement_of(name: str, cores: tuple[int, int] | None) -> Placement:
    """`name` of PLACEMENTS on (victim core, storm core); nothing pinned with one core."""
    if cores is None:
        return Placement((), None, None, None)
    victim, storm = cores
    if name == "split":  # the server places itself; the victim's client stands in for another machine
        return Placement(("--engine-cpus", str(victim), "--api-cpus", str(storm)), cores, storm, None)
    assert name == "server-core", name
    return Placement((), victim, victim, storm)


def _gaps(stamps: list[list[float]], lo: float = float("-inf"), hi: float = float("inf")) -> list[float]:
    """Inter-token gaps whose later token arrived within [lo, hi]."""
    return [b - a for s in stamps for a, b in zip(s[1:], s[2:]) if lo <= b <= hi]


def _victim_view(stamps: list[list[float]], lo: float, hi: float) -> dict:
    """The victim's tokens per second within [lo, hi] and the TTFT of its streams started in it: a
    storm that holds its new streams back shows there, not in its inter-token gaps."""
    tokens = sum(1 for s in stamps for t in s[1:] if lo <= t <= hi)
    ttfts = [s[1] - s[0] for s in stamps if lo <= s[0] <= hi]
    return {"tokens_per_s": round(tokens / (hi - lo), 2), "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_max_ms": _ms(max(ttfts, default=None))}


def _tier_counts(url: str, admin_token: str) -> dict[str, float]:
    """The adapter tiers' hit, miss (a load into the tier) and eviction counters from /metrics, e.g.
    'device misses' = slot loads, 'host misses' = page-ins from Redis."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_token}"}, timeout=60).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("loraplex_adapter_tier_") and 'tier="' in line:
            name, _, value = line.rpartition(" ")
            kind = name.split("{")[0].removeprefix("loraplex_adapter_tier_")
            if kind in ("hits", "misses", "evictions"):
                tier = name.split('tier="', 1)[1].split('"', 1)[0]
                counts[f"{tier} {kind}"] = float(value)
    return counts


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


@contextlib.contextmanager
def _sampled(pid: int, directory: Path | None, phase: str, profiles: dict) -> Iterator[None]:
    """Runs a phase, sampled by py-spy into `directory/<phase>.txt` when `directory` is set; its summary
    lands in profiles[phase], with the kernel's times of the server's threads (benchmarks.profile.thread_times)
    and the machine's busiest processes (benchmarks.profile.cpu_neighbours)."""
    if directory is None:
        yield
        return
    out, start = directory / f"{phase}.txt", time.perf_counter()
    core = core_share.engine_core_pid(pid)
    with Sampler(pid, out) as sampler:
        before, machine_before = thread_times.snapshot(pid), cpu_neighbours.snapshot()
        core_before = core and thread_times.snapshot(core)
        yield
        after, wall = thread_times.snapshot(pid), time.perf_counter() - start
        core_after = core and thread_times.snapshot(core)
        machine = cpu_neighbours.busiest(machine_before, cpu_neighbours.snapshot(), wall)
    names = thread_times.thread_names(out)
    profiles[phase] = {**summarize(out, wall, sampler.rate, engine_core=core),
                       "threads": thread_times.phase_times(before, after, names, wall),
                       "machine": machine}
    if core_before and core_after:  # the step loop is the engine-core process's main thread
        profiles[phase]["engine_core_threads"] = thread_times.phase_times(core_before, core_after, names, wall)


def _arm(name: str, work: Path, model_dir: Path, endpoint: str, cold: int, cores: tuple[int, int] | None,
         placement: str, profile_dir: Path | None = None) -> dict:
    where = placement_of(placement, cores)
    flags = [*ARMS[name], *where.serve_flags]
    serve = ["--adapter-sources", "s3", "--adapter-s3-endpoint", endpoint, "--adapter-s3-buckets", BUCKET,
             "--device", "cpu", "--max-lora-rank", "64", "--cpu-threads", "1", *flags]
    client_core = where.client_core
    load_before = os.getloadavg()
    data = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    with pinned(where.server_cores):  # the server and its threads start there
        server = ServerProcess(data, data / "server.log", model_dir=model_dir, serve_args=serve)
        srv = server.__enter__()
    try:
        pinned_children = []
        if where.pin_children_to is not None:
            engine_core = core_share.engine_core_pid(srv.proc.pid)
            for pid in children(srv.proc.pid):  # Redis and the loader processes: the storm's side
                if pid != engine_core:  # the engine core stays with the front end on the victim's core
                    pin_process(pid, where.pin_children_to)
                    pinned_children.append(pid)
        keys, base = provision(srv.url, srv.admin_token, ["steady", "cold"], {})
        auth = {"Authorization": f"Bearer {keys['cold']}"}
        with httpx.Client(base_url=srv.url, headers=auth, timeout=60) as c:
            for i in range(cold + 1):
                c.post("/v1/adapters", json={"name": f"a{i}", "source": f"s3://{BUCKET}/a{i}"}).raise_for_status()
        # Start-up work the server does in the background ends before the baseline: one constrained request
        # waits for the grammar compile pool (its fork server imports xgrammar and torch), then the server's
        # CPU settles (as the victim benches do).
        httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {keys['steady']}"},
                   timeout=SETTLE_TIMEOUT_S, json={"model": base, "prompt": "x", "max_tokens": 1,
                                                   "guided_choice": ["warm"]}).raise_for_status()
        if sys.platform == "linux":
            settle(srv.proc.pid)
        stream(srv.url, keys["steady"], base, 8)  # warm-up
        warm_ttft = min(stream(srv.url, keys["steady"], base, 1)[0] for _ in range(5))
        cold_ttft, _ = stream(srv.url, keys["cold"], "a0", 1)
        again_ttft, _ = stream(srv.url, keys["cold"], "a0", 1)
        profiles: dict = {}
        pid = srv.proc.pid
        with _sampled(pid, profile_dir, "quiet", profiles):
            with VictimProcess(srv.url, keys["steady"], base, client_core, QUIET_STREAMS) as victim:
                pass
            quiet = victim.stamps
        tiers = [_tier_counts(srv.url, srv.admin_token)]
        with _sampled(pid, profile_dir, "storm", profiles):
            storm, storm_stamps, t0, t1 = _storm(srv.url, keys, base, cold, client_core)
        tiers.append(_tier_counts(srv.url, srv.admin_token))
        # The same 100 first uses again, now fetched: what the storm's own requests cost the victim
        # (their prefills share its steps), whoever loads adapters.
        with _sampled(pid, profile_dir, "warm_storm", profiles):
            warm, warm_stamps, w0, w1 = _storm(srv.url, keys, base, cold, client_core)
        tiers.append(_tier_counts(srv.url, srv.admin_token))
    finally:
        server.__exit__(None, None, None)
    quiet_gaps = _gaps(quiet)
    victim = {"quiet": _victim_view(quiet, quiet[0][0], quiet[-1][-1]), "storm": _victim_view(storm_stamps, t0, t1),
              "warm_storm": _victim_view(warm_stamps, w0, w1)}
    storm_gaps, warm_gaps = _gaps(storm_stamps, t0, t1), _gaps(warm_stamps, w0, w1)
    itl_quiet, itl_storm = percentile(quiet_gaps, 99), percentile(storm_gaps, 99)
    return {
        "arm": name, "placement": placement if cores else None, "serve_flags": flags,
        "pinned_children": len(pinned_children),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "base_ttft_ms": _ms(warm_ttft), "cold_first_request_ttft_ms": _ms(cold_ttft),
        "same_adapter_again_ttft_ms": _ms(again_ttft),
        "storm": {"adapters": cold, "failed": cold - len(storm), "wall_ms": _ms(t1 - t0), "ttft_p50_ms": _ms(percentile(storm, 50)),
                  "ttft_p99_ms": _ms(percentile(storm, 99)), "tier_counts": _delta(tiers[0], tiers[1])},
        "warm_storm": {"failed": cold - len(warm), "wall_ms": _ms(w1 - w0), "ttft_p50_ms": _ms(percentile(warm, 50)),
                       "ttft_p99_ms": _ms(percentile(warm, 99)), "tier_counts": _delta(tiers[1], tiers[2])},
        "other_tenant_itl_ms": {"quiet_p50": _ms(percentile(quiet_gaps, 50)), "quiet_p99": _ms(itl_quiet),
                                "storm_p50": _ms(percentile(storm_gaps, 50)), "storm_p99": _ms(itl_storm),
                                "warm_storm_p50": _ms(percentile(warm_gaps, 50)),
                                "warm_storm_p99": _ms(percentile(warm_gaps, 99)),
                                "quiet_gaps": len(quiet_gaps), "storm_gaps": len(storm_gaps),
                                "warm_storm_gaps": len(warm_gaps)},
        "other_tenant": victim,
        "itl_p99_ratio": round(itl_storm / itl_quiet, 3) if itl_quiet and itl_storm else None,
        **({"server_profile": profiles} if profiles else {}),
    }


def _storm(url: str, keys: dict[str, str], base: str, cold: int, client_core: int | None
           ) -> tuple[list[float], list[float], float, float]:
    """First uses of a1..a{cold} from 32 clients while the victim streams: (their TTFTs, the victim's
    streams' stamps, the storm's start, its end). A storm request that fails (a 503 when Redis timed out
    on this loaded machine) has no TTFT; their count is cold minus len(TTFTs)."""
    with VictimProcess(url, keys["steady"], base, client_core) as victim:
        time.sleep(VICTIM_START_S)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            ttfts = [t for t in pool.map(lambda i: _storm_ttft(url, keys["cold"], f"a{i}"), range(1, cold + 1))
                     if t is not None]
        t1 = time.perf_counter()
    return ttfts, victim.stamps, t0, t1


def _storm_ttft(url: str, key: str, model: str) -> float | None:
    try:
        return stream(url, key, model, 1)[0]
    except httpx.HTTPStatusError:
        return None


def _parts(endpoint: str, model_dir: Path) -> dict:
    """Fetch and validation of one adapter, measured on their own in this process."""
    policy = SourcePolicy(kinds=frozenset({"s3"}), s3_endpoint=endpoint)
    t0 = time.perf_counter()
    files = fetch_adapter(parse_reference(f"s3://{BUCKET}/a0"), policy)
    fetch_s = time.perf_counter() - t0
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    t0 = time.perf_counter()
    summary = inspect_adapter_bytes(files.config_json, files.weights, shape, 64)
    load_adapter_bytes(summary.canonical_config_json, files.weights, shape, 64)
    return {"adapter_bytes": len(files.weights), "fetch_ms": _ms(fetch_s),
            "validate_ms": _ms(time.perf_counter() - t0)}


def _loads(counts: dict[str, float]) -> str:
    return f"{counts.get('device misses', 0):.0f} / {counts.get('host misses', 0):.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the demo model)")
    ap.add_argument("--cold", type=int, default=100, help="adapters in the cold storm (default 100)")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    ap.add_argument("--rounds", type=int, default=1, help="times each arm runs, interleaved (default 1)")
    ap.add_argument("--arms", default="in-process,loaders",
                    help=f"comma-separated, of {', '.join(ARMS)} (default in-process,loaders)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split",
                    help="split (default): the server on both cores, its engine core alone on the victim's "
                         "(--engine-cpus, --api-cpus); server-core: the whole server on the victim's core, Redis "
                         "and the loaders on the storm's (the layout before the engine-core process)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="sample the server with py-spy through each phase (raw stacks in "
                         "DIR/<arm>-<round>/<phase>.txt) and report its CPU by category (default: off)")
    ap.add_argument("--out", default="bench-cold-sources.json", help="JSON output (default bench-cold-sources.json)")
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        ap.error(f"unknown arm(s) {sorted(unknown)}")
    if args.profile and can_profile() is not None:
        ap.error(f"--profile: {can_profile()}")
    from moto.server import ThreadedMotoServer

    cores = two_cores()
    pin_thread(cores[1] if cores else None)  # this thread (moto, the storm's clients) is the storm's side
    work = Path(tempfile.mkdtemp(prefix="lp-cold-"))
    model_dir = Path(args.model) if args.model else ensure_demo(work / "demo").model_dir
    adapters = ensure_adapters(model_dir, work / "adapters", list(range(args.cold + 1)), r=args.rank)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    runs = []
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        for i, d in adapters.items():
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                s3.put_object(Bucket=BUCKET, Key=f"a{i}/{f}", Body=(d / f).read_bytes())
        parts = _parts(endpoint, model_dir)
        for r in range(args.rounds):
            for name in arms:
                print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
                profile_dir = Path(args.profile) / f"{name}-{r + 1}" if args.profile else None
                runs.append({"round": r + 1, **_arm(name, work, model_dir, endpoint, args.cold, cores,
                                                    args.placement, profile_dir)})
                # Kept as it goes: a later arm that fails on this shared machine loses only itself.
                Path(args.out).write_text(json.dumps({"partial": True, "runs": runs}, indent=2))
    finally:
        moto.stop()
    summary = {}
    for name in arms:
        mine = [run for run in runs if run["arm"] == name]
        ratios = [run["itl_p99_ratio"] for run in mine if run["itl_p99_ratio"] is not None]
        summary[name] = {"itl_p99_ratio_median": statistics.median(ratios) if ratios else None,
                         "itl_p99_ratios": ratios}
    result = {"machine": {"cpu_count": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)) if not cores
                          else 2, "victim_core": cores[0] if cores else None,
                          "storm_core": cores[1] if cores else None,
                          "placement": args.placement if cores else None},
              "adapter": {"rank": args.rank, **parts}, "runs": runs, "summary": summary}
    print(f"\none adapter from S3: fetch {parts['fetch_ms']} ms, validation {parts['validate_ms']} ms "
          f"({parts['adapter_bytes']} bytes)")
    rows = [("round", lambda x: x["round"]), ("arm", lambda x: x["arm"]),
            ("load avg (1 min) before", lambda x: f"{x['load_avg_before'][0]:.2f}"),
            ("base TTFT ms", lambda x: x["base_ttft_ms"]),
            ("cold first request TTFT ms", lambda x: x["cold_first_request_ttft_ms"]),
            ("same adapter again TTFT ms", lambda x: x["same_adapter_again_ttft_ms"]),
            (f"storm of {args.cold}: wall ms", lambda x: x["storm"]["wall_ms"]),
            ("storm TTFT p50 / p99 ms", lambda x: f"{x['storm']['ttft_p50_ms']} / {x['storm']['ttft_p99_ms']}"),
            ("other tenant ITL p50 quiet / storm ms",
             lambda x: f"{x['other_tenant_itl_ms']['quiet_p50']} / {x['other_tenant_itl_ms']['storm_p50']}"),
            ("other tenant ITL p99 quiet / storm ms",
             lambda x: f"{x['other_tenant_itl_ms']['quiet_p99']} / {x['other_tenant_itl_ms']['storm_p99']}"),
            ("ITL p99 storm / quiet", lambda x: x["itl_p99_ratio"]),
            ("other tenant tokens/s quiet / storm",
             lambda x: f"{x['other_tenant']['quiet']['tokens_per_s']} / {x['other_tenant']['storm']['tokens_per_s']}"),
            ("other tenant TTFT p50 quiet / storm ms",
             lambda x: f"{x['other_tenant']['quiet']['ttft_p50_ms']} / {x['other_tenant']['storm']['ttft_p50_ms']}"),
            ("warm storm again: wall ms", lambda x: x["warm_storm"]["wall_ms"]),
            ("other tenant ITL p50 / p99 warm storm ms",
             lambda x: f"{x['other_tenant_itl_ms']['warm_storm_p50']} / {x['other_tenant_itl_ms']['warm_storm_p99']}"),
            ("other tenant tokens/s warm storm", lambda x: x["other_tenant"]["warm_storm"]["tokens_per_s"]),
            ("slot loads / page-ins, storm", lambda x: _loads(x["storm"]["tier_counts"])),
            ("slot loads / page-ins, warm storm", lambda x: _loads(x["warm_storm"]["tier_counts"]))]
    width = max(len(r[0]) for r in rows)
    for label, get in rows:
        print(f"{label:<{width}}  " + "  ".join(f"{str(get(run)):>22}" for run in runs))
    for run in runs:
        for phase, summary in run.get("server_profile", {}).items():
            label = f"{run['arm']} (round {run['round']}) {phase}"
            print("\n".join(profile_lines(label, summary) + thread_times.thread_lines(label, summary["threads"])
                            + (thread_times.thread_lines(f"{label} (engine core)", summary["engine_core_threads"])
                               if "engine_core_threads" in summary else [])
                            + cpu_neighbours.neighbour_lines(label, summary["machine"])))
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
