"""CPU placement (`--engine-cpus`, `--api-cpus`): the engine on cores of its own, and the grammar-compile
processes, adapter-loader processes, the embedded Redis and (with an engine-core process) the HTTP
front end on the rest.

Why: on a small machine a compile flood or a cold-load storm ran its processes on the core the step
loop was using, and every tenant's next token waited for them (issue 43's compile_flood phase, issue
35's build item 6). Pinned apart, that work competes only with the front end.

The automatic split, with `--engine-process separate` on a process allowed N >= 2 cores: the last
max(1, N // 4) of them go to the front end side, the others to the engine (2 cores: engine 0, front
end 1; 8: engine 0-5, front end 6-7). On one core nothing is pinned; in-process nothing is pinned
unless a flag asks: there the one interpreter's HTTP threads and step loop share a GIL and a core, and
pinning it measured no better than the unpinned layout under a compile flood (1.8-2.1x either way,
docs/benchmarks/abuse.md), while it would put every in-process server of a machine on the same core. Either flag alone takes its cores and leaves the rest to the
other side; both must be disjoint, non-empty and within the cores this process may use.

`loraplex serve` applies it (server.cli). With `--engine-process separate` the server process is the
front end, on the front end's cores, and the engine-core process moves itself onto the engine's (its
own loader process goes back to the front end's). In-process, the whole server process goes on the
engine's cores: its HTTP threads share the step loop's GIL, and split from it across cores they made
the victim's tail latency several times worse (docs/benchmarks/abuse.md); its compile and loader
processes are pinned to the front end side's cores as they start.
"""
from __future__ import annotations

from dataclasses import dataclass

from server.cpu_list import Cpus, CpuListError, format_cpu_list, parse_cpu_list

API_SHARE = 4  # the front end side's share of an automatic split: one core in four, at least one


class CpuPlacementError(ValueError):
    """Flags that name no cores, overlapping cores or cores this process may not use; one line."""


@dataclass(frozen=True)
class CpuPlacement:
    engine: Cpus  # the step loop and its torch threads (the engine-core process, when separate)
    api: Cpus  # HTTP front end, grammar-compile and adapter-loader processes

    def line(self, separate: bool, engines: int = 1) -> str:
        if separate:
            who = "engine-core process" if engines == 1 else f"{engines} engine-core processes (a share each)"
            return (f"cpu placement: {who} on cores {format_cpu_list(self.engine)}; HTTP front end, "
                    f"grammar compiles, adapter loaders and Redis on cores {format_cpu_list(self.api)}")
        return (f"cpu placement: server process (HTTP and the engine's step loop, one interpreter) on cores "
                f"{format_cpu_list(self.engine)}; grammar compiles, adapter loaders and Redis on cores "
                f"{format_cpu_list(self.api)}")


def unpinned_line(allowed: Cpus) -> str:
    if len(allowed) < 2:
        return f"cpu placement: one core ({format_cpu_list(allowed)}), nothing pinned"
    return (f"cpu placement: cores {format_cpu_list(allowed)}, nothing pinned (the engine in the server's process; "
            f"--engine-cpus/--api-cpus pin it)")


def _cores(flag: str, text: str, allowed: Cpus) -> Cpus:
    try:
        cores = parse_cpu_list(text)
    except CpuListError as e:
        raise CpuPlacementError(f"{flag}: {e}") from None
    if outside := sorted(set(cores) - set(allowed)):
        raise CpuPlacementError(f"{flag} {text}: core(s) {format_cpu_list(tuple(outside))} are not among the "
                                f"cores this process may use ({format_cpu_list(allowed)})")
    return cores


def plan_placement(engine_cpus: str | None, api_cpus: str | None, allowed: Cpus,
                   automatic: bool = True, engine_groups: int = 1) -> CpuPlacement | None:
    """The placement the flags (None: not given) ask for on `allowed` cores, or with neither flag the
    automatic split where `automatic` (an engine-core process of its own); None: nothing pinned.
    `engine_groups`: --data-parallel-size, engine cores that each need a core of their own: where the
    split leaves fewer engine cores than that, the engine side takes every core and the front end
    shares them (a 2-core machine at DP 2: one core per engine core)."""
    if engine_cpus is None and api_cpus is None:
        if not automatic or len(allowed) < 2:
            return None
        split = len(allowed) - max(1, len(allowed) // API_SHARE)
        if split < engine_groups:
            return CpuPlacement(engine=allowed, api=allowed)
        return CpuPlacement(engine=allowed[:split], api=allowed[split:])
    engine = _cores("--engine-cpus", engine_cpus, allowed) if engine_cpus is not None else None
    api = _cores("--api-cpus", api_cpus, allowed) if api_cpus is not None else None
    if engine is not None and api is not None:
        if shared := sorted(set(engine) & set(api)):
            raise CpuPlacementError(f"--engine-cpus {engine_cpus} and --api-cpus {api_cpus} overlap on core(s) "
                                    f"{format_cpu_list(tuple(shared))}: give each side cores of its own")
        return CpuPlacement(engine=engine, api=api)
    given, flag, text = (engine, "--engine-cpus", engine_cpus) if engine is not None else (api, "--api-cpus", api_cpus)
    rest = tuple(c for c in allowed if c not in given)
    if not rest:
        raise CpuPlacementError(f"{flag} {text} leaves no core for the other side (this process may use "
                                f"{format_cpu_list(allowed)})")
    return CpuPlacement(engine=given, api=rest) if engine is not None else CpuPlacement(engine=rest, api=given)
