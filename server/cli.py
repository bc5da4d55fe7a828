"""`loraplex serve`: the CLI of DESIGN.md ("CLI"), plus --data-dir."""
from __future__ import annotations

import argparse
import socket
import sys

from server.config import ConfigError, ServerConfig
from server.version import loraplex_version


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant LoRA serving.")
    parser.add_argument("--version", action="version", version=f"loraplex {loraplex_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("--model", help="Hugging Face model directory (default: the built-in demo model)")
    s.add_argument("--served-model-name", help="model id clients send (default: the directory name)")
    s.add_argument("--redis-url", help="Redis 6+ URL (or $LORAPLEX_REDIS_URL, which keeps a password out of `ps`; "
                                        "default: an embedded redis-server)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    s.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    s.add_argument("--adapter", action="append", metavar="NAME=DIR",
                   help="preload a PEFT adapter into the `default` tenant (repeatable)")
    s.add_argument("--max-loras", type=_positive_int, default=8)
    s.add_argument("--max-lora-rank", type=_positive_int, default=64)
    s.add_argument("--max-model-len", type=_positive_int)
    s.add_argument("--max-num-seqs", type=_positive_int, default=256)
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    kv = s.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=_positive_int)
    kv.add_argument("--gpu-memory-utilization", type=_fraction)
    s.add_argument("--max-cpu-lora-bytes", type=_positive_int,
                   help="host-tier budget: bytes of parsed adapters kept in host memory (default 1 GiB)")
    s.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto")
    s.add_argument("--quantization", metavar="int8",
                   help="store the base model's decoder projections quantized: int8 is weight-only with "
                        "per-output-channel scales, CPU only; adapters and lm_head stay float "
                        "(default: none, the checkpoint's float weights)")
    s.add_argument("--cpu-threads", default="auto", metavar="auto|N",
                   help="torch threads on a CPU device: auto (default) = the cores in this process's "
                        "affinity mask, less one for the HTTP side when there is more than one")
    s.add_argument("--admin-token", help="admin bearer token (or $LORAPLEX_ADMIN_TOKEN; "
                                         "generated and printed when neither is set)")
    s.add_argument("--max-request-bytes", type=_positive_int, default=16 << 20,
                   help="largest JSON request body accepted, in bytes (default 16 MiB); larger is a 413")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes a tenant sent before, per adapter version (default on)")
    s.add_argument("--share-base-prefix-cache", action="store_true",
                   help="let base-model prefix blocks be reused across tenants: faster, but a tenant can tell "
                        "from time to first token whether another sent a prompt (off by default)")
    s.add_argument("--max-batch-prompts", type=_positive_int, default=64,
                   help="most prompts in one /v1/completions batch (a list of prompts); default 64")
    s.add_argument("--metrics-token", help="bearer token that may read /metrics besides the admin token "
                                           "(or $LORAPLEX_METRICS_TOKEN), for Prometheus' bearer_token")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without credentials (it names tenants: only on a private network)")
    s.add_argument("--replica-name", help="this replica's name among several behind one proxy, shown in "
                                          "/health, /version, the x-loraplex-replica header and /metrics "
                                          "(default: hostname:port)")
    s.add_argument("--data-dir", help="embedded Redis and demo model live here (or "
                                      "$LORAPLEX_DATA_DIR; default ~/.local/share/loraplex)")
    from server.bench.cli import add_bench_parser  # argparse only at import: --help stays fast

    add_bench_parser(sub)
    return parser


def _banner(info) -> None:
    lines = ["", f"loraplex is serving {info.model_id} at {info.base_url}"]
    if info.admin_token_file is not None:
        lines.append(f"admin token (kept in {info.admin_token_file}): {info.admin_token}")
    else:
        lines.append("admin token: as given by --admin-token / LORAPLEX_ADMIN_TOKEN")
    if info.demo_key is not None:
        lines.append(f"demo tenant API key (kept in {info.demo_key_file}): {info.demo_key}")
        if info.demo_adapters:
            lines.append(f"demo adapters: {', '.join(info.demo_adapters)}")
        lines.append("try:")
        lines.append(f"  {info.curl_line()}")
    lines.append("")
    print("\n".join(lines), flush=True)


def bind_listener(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts: a port in use is reported at once,
    not after the model is built and credentials printed for a server that would never start."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(config: ServerConfig, sock: socket.socket) -> None:
    import uvicorn

    from server.api.app import create_app

    app = create_app(config, on_ready=_banner)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from server.bench.cli import run_bench

        return run_bench(args)
    try:
        sock = bind_listener(args.host, args.port)
    except OSError as e:
        print(f"loraplex: error: cannot listen on {args.host}:{args.port}: {e.strerror or e} "
              f"(is another server running there? pick another --port)", file=sys.stderr)
        return 2
    with sock:
        try:
            config = ServerConfig.from_args(args)
        except ConfigError as e:
            print(f"loraplex: error: {e}", file=sys.stderr)
            return 2
        serve(config, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
