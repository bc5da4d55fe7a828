"""`loraplex serve` with the engine side and the front end both on every core this process may use.

For benchmarks/serving/data_parallel.py's baseline: one engine core with both of a 2-core machine's cores
(the flags cannot say it: --engine-cpus and --api-cpus must be disjoint, and the automatic split keeps a
core for the front end), compared with --data-parallel-size 2 on the same placement, one core each.

    python -m benchmarks.serving.shared_cores_serve serve --model ... --engine-process separate ...
"""
from __future__ import annotations

import dataclasses
import sys

from server.cli import bind_listener, build_parser, log_to_stderr, prepare_model, serve
from server.config import ServerConfig
from server.cpu_list import allowed_cpus
from server.cpu_placement import CpuPlacement


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with bind_listener(args.host, args.port) as sock:
        log_to_stderr()
        config = ServerConfig.from_args(args)
        cores = allowed_cpus()
        config = dataclasses.replace(config, cpu_placement=CpuPlacement(engine=cores, api=cores))
        prepare_model(config)
        return serve(config, sock)


if __name__ == "__main__":
    sys.exit(main())
