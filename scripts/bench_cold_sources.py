"""Cold adapters from S3 (moto's S3 server on loopback): what the first request to a never-seen
adapter waits for (fetch, validation, first token), and what a storm of cold first uses does to
another tenant's inter-token latency. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_cold_sources.py [--model DIR] [--cold 100] [--rank 16] [--out F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.format import ModelShape, inspect_adapter_bytes, load_adapter_bytes  # noqa: E402
from adapters.sources import SourcePolicy, fetch_adapter, parse_reference  # noqa: E402
from server.bench.metrics import percentile  # noqa: E402
from server.bench.server_proc import ServerProcess, free_port, provision  # noqa: E402
from server.bench.synth_adapters import ensure_adapters  # noqa: E402
from server.demo import ensure_demo  # noqa: E402

BUCKET = "bench"


def _stream(url: str, key: str, model: str, max_tokens: int) -> tuple[float, list[float]]:
    """(time to first token, gaps between later tokens) of one streamed completion."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def _steady(url: str, key: str, model: str, stop: threading.Event, gaps: list[float]) -> None:
    while not stop.is_set():
        gaps.extend(_stream(url, key, model, 32)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the demo model)")
    ap.add_argument("--cold", type=int, default=100, help="adapters in the cold storm (default 100)")
    ap.add_argument("--rank", type=int, default=16, help="adapter rank (default 16)")
    ap.add_argument("--out", default="bench-cold-sources.json", help="JSON output (default bench-cold-sources.json)")
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    work = Path(tempfile.mkdtemp(prefix="lp-cold-"))
    model_dir = Path(args.model) if args.model else ensure_demo(work / "demo").model_dir
    adapters = ensure_adapters(model_dir, work / "adapters", list(range(args.cold + 1)), r=args.rank)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        for i, d in adapters.items():
            for f in ("adapter_config.json", "adapter_model.safetensors"):
                s3.put_object(Bucket=BUCKET, Key=f"a{i}/{f}", Body=(d / f).read_bytes())
        # The parts, measured on their own in this process.
        policy = SourcePolicy(kinds=frozenset({"s3"}), s3_endpoint=endpoint)
        t0 = time.perf_counter()
        files = fetch_adapter(parse_reference(f"s3://{BUCKET}/a0"), policy)
        fetch_s = time.perf_counter() - t0
        shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        t0 = time.perf_counter()
        summary = inspect_adapter_bytes(files.config_json, files.weights, shape, 64)
        load_adapter_bytes(summary.canonical_config_json, files.weights, shape, 64)
        validate_s = time.perf_counter() - t0
        serve = ["--adapter-sources", "s3", "--adapter-s3-endpoint", endpoint, "--adapter-s3-buckets", BUCKET,
                 "--device", "cpu", "--max-lora-rank", "64"]
        with ServerProcess(work / "data", work / "server.log", model_dir=model_dir, serve_args=serve) as srv:
            keys, base = provision(srv.url, srv.admin_token, ["steady", "cold"], {})
            auth = {"Authorization": f"Bearer {keys['cold']}"}
            for i in adapters:
                httpx.post(f"{srv.url}/v1/adapters", headers=auth, timeout=60,
                           json={"name": f"a{i}", "source": f"s3://{BUCKET}/a{i}"}).raise_for_status()
            _stream(srv.url, keys["steady"], base, 8)  # warm-up
            warm_ttft = min(_stream(srv.url, keys["steady"], base, 1)[0] for _ in range(5))
            cold_ttft, _ = _stream(srv.url, keys["cold"], "a0", 1)
            again_ttft, _ = _stream(srv.url, keys["cold"], "a0", 1)
            gaps_quiet: list[float] = []
            for _ in range(8):
                gaps_quiet.extend(_stream(srv.url, keys["steady"], base, 32)[1])
            gaps_storm: list[float] = []
            stop = threading.Event()
            steady = threading.Thread(target=_steady, args=(srv.url, keys["steady"], base, stop, gaps_storm))
            steady.start()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(32) as pool:
                storm = list(pool.map(lambda i: _stream(srv.url, keys["cold"], f"a{i}", 1)[0], range(1, args.cold + 1)))
            storm_s = time.perf_counter() - t0
            stop.set()
            steady.join()
    finally:
        moto.stop()
    result = {
        "adapter": {"rank": args.rank, "bytes": len(files.weights)},
        "fetch_s": fetch_s, "validate_s": validate_s, "base_ttft_s": warm_ttft,
        "cold_first_request_ttft_s": cold_ttft, "same_adapter_again_ttft_s": again_ttft,
        "storm": {"adapters": args.cold, "wall_s": storm_s, "ttft_p50_s": percentile(storm, 50),
                  "ttft_p99_s": percentile(storm, 99)},
        "other_tenant_itl_p99_s": {"quiet": percentile(gaps_quiet, 99), "during_storm": percentile(gaps_storm, 99)},
    }
    rows = [("fetch from S3 (one adapter)", fetch_s), ("validation (header, config, values)", validate_s),
            ("base-model TTFT (one step and HTTP)", warm_ttft), ("cold adapter: first request TTFT", cold_ttft),
            ("same adapter again: TTFT", again_ttft), (f"storm of {args.cold} cold first uses: wall", storm_s),
            ("storm TTFT p50", result["storm"]["ttft_p50_s"]), ("storm TTFT p99", result["storm"]["ttft_p99_s"]),
            ("other tenant ITL p99, quiet", result["other_tenant_itl_p99_s"]["quiet"]),
            ("other tenant ITL p99, during storm", result["other_tenant_itl_p99_s"]["during_storm"])]
    width = max(len(r[0]) for r in rows)
    for name, seconds in rows:
        print(f"{name:<{width}}  {seconds * 1000:10.2f} ms")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
