"""How a steady window's engine steps ran: graphed (a decode step replaying a CUDA graph) or eager (every step
with a prompt chunk, any decode step without a captured graph, all of them on a CPU or with --enforce-eager).

On the GPU the two differ several-fold in time (issue 41's H200 run: a base decode step replayed in ~8.7 ms at
64 sequences, a step with a prompt chunk took 25 ms, 50 ms with LoRA), and a closed loop refilling 64 slots
admits a prompt every few steps, so a window's tok/s mixes them: the row says in what proportion.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSample:
    end_s: float  # when the engine's step() returned, on the run's clock (that of its token times)
    seconds: float  # the step() call's wall time: schedule, run and post-processing
    graphed: bool  # it replayed a decode CUDA graph


def step_kinds(samples: list[StepSample], start_s: float, end_s: float) -> dict:
    """The steps that ended in the window [start_s, end_s) (the window whose tokens metrics.window_summary
    counts), split by kind, with the wall time each kind took."""
    inside = [s for s in samples if start_s <= s.end_s < end_s]
    graphed = [s.seconds for s in inside if s.graphed]
    eager = [s.seconds for s in inside if not s.graphed]
    return {"steps": len(inside), "graphed": len(graphed), "eager": len(eager),
            "graphed_s": sum(graphed), "eager_s": sum(eager),
            "graphed_ms_mean": 1e3 * sum(graphed) / len(graphed) if graphed else None,
            "eager_ms_mean": 1e3 * sum(eager) / len(eager) if eager else None}
