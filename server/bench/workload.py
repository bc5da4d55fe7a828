"""The workload generator, shaped like S-LoRA's synthetic traces.

Adapter popularity: adapter = floor(n * u) with u ~ power(alpha) on [0, 1)
(density alpha * u^(alpha-1), numpy.random.power's law): alpha = 1 is uniform,
smaller alpha piles requests onto the first few adapters; round_robin instead
sends request i to adapter i mod n (Punica's "distinct": every n requests in a
row use every adapter once). Arrivals: gamma
inter-arrival times with shape 1/cv^2 and scale cv^2/rate (cv = 1 is Poisson;
rate = inf sends everything at t = 0, which measures capacity). Prompt and
output lengths are uniform integers over inclusive ranges. Adapter i belongs to
tenant i mod num_tenants.

Two seeded streams, so a seed always gives the same trace: the trace's
(arrivals, prompts, output lengths) from `random.Random(seed)`, and who each
request goes to (base or adapter, which adapter, a base request's tenant) from
its own `adapter_rng(seed)`. The adapter count, popularity and base share so
never move a prompt or a length: the base run is the same trace with no
adapter, and both have the same prompt and output token totals (ignore_eos).

The prefix workload (`generate_conversations`) is chat traffic: every tenant
has a system prompt of `shared_prefix_len` tokens that starts all its
prompts, and each conversation runs `turns` turns `turn_gap_s` apart, each
resending the conversation so far (system prompt, earlier user messages and
replies) plus a new user message of `prompt_len` tokens. The resent replies
are drawn tokens of each turn's output length, standing for what the client
would resend; the server's own output is not fed back, so every run gets the
same prompts.
"""
from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass


class WorkloadError(ValueError):
    """A workload was asked for with parameters that cannot describe one."""


@dataclass(frozen=True)
class WorkloadConfig:
    num_adapters: int
    num_requests: int | None = None    # exactly one of num_requests and duration_s
    duration_s: float | None = None    # with a finite rate: num_requests = int(rate * duration_s)
    rate: float = math.inf             # requests per second; inf = all at t = 0
    cv: float = 1.0                    # coefficient of variation of inter-arrival times
    alpha: float = 1.0                 # power-law popularity exponent; 1 = uniform
    round_robin: bool = False          # adapter = request index mod n (Punica's "distinct"), alpha unused
    prompt_len: tuple[int, int] = (8, 64)   # inclusive token range
    output_len: tuple[int, int] = (8, 64)   # inclusive token range
    num_tenants: int = 1
    base_share: float = 0.0            # share of requests for the base model (no adapter)
    token_range: tuple[int, int] = (3, 512)  # prompt token ids drawn from [lo, hi): skips special tokens
    seed: int = 0
    # generate_conversations only: num_requests counts turns; rate and cv pace conversation starts.
    shared_prefix_len: int = 0         # each tenant's system prompt, starting all its prompts
    turns: int = 1                     # turns per conversation, each resending the conversation so far
    turn_gap_s: float = 0.0            # between the arrivals of a conversation's turns

    def __post_init__(self) -> None:
        if self.num_adapters < 0:
            raise WorkloadError(f"num_adapters must be >= 0, got {self.num_adapters}")
        if self.num_adapters == 0 and self.base_share != 1.0:
            object.__setattr__(self, "base_share", 1.0)  # no adapters: everything goes to the base model
        if (self.num_requests is None) == (self.duration_s is None):
            raise WorkloadError("give exactly one of num_requests and duration_s")
        if self.num_requests is not None and self.num_requests < 1:
            raise WorkloadError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None:
            if not math.isfinite(self.rate):
                raise WorkloadError("duration_s needs a finite rate (requests = rate * duration)")
            if self.duration_s <= 0 or int(self.rate * self.duration_s) < 1:
                raise WorkloadError(f"rate * duration_s must give at least one request, got "
                                    f"{self.rate} * {self.duration_s}")
        if not self.rate > 0:
            raise WorkloadError(f"rate must be > 0 (inf for all at once), got {self.rate}")
        if not self.cv > 0:
            raise WorkloadError(f"cv must be > 0, got {self.cv}")
        if not self.alpha > 0:
            raise WorkloadError(f"alpha must be > 0, got {self.alpha}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise WorkloadError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.num_tenants < 1:
            raise WorkloadError(f"num_tenants must be >= 1, got {self.num_tenants}")
        if not 0.0 <= self.base_share <= 1.0:
            raise WorkloadError(f"base_share must be in [0, 1], got {self.base_share}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise WorkloadError(f"token_range must be 0 <= lo < hi, got {self.token_range}")
        if self.shared_prefix_len < 0:
            raise WorkloadError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.turns < 1:
            raise WorkloadError(f"turns must be >= 1, got {self.turns}")
        if not self.turn_gap_s >= 0:
            raise WorkloadError(f"turn_gap_s must be >= 0, got {self.turn_gap_s}")

    @property
    def total_requests(self) -> int:
        if self.num_requests is not None:
            return self.num_requests
        return int(self.rate * self.duration_s)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float            # offset from the start of the run
    adapter: int | None         # adapter index, None = base model
    tenant: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    turn: int = 0               # generate_conversations: the turn within its conversation

    @property
    def adapter_name(self) -> str | None:
        return None if self.adapter is None else adapter_name(self.adapter)


def adapter_name(i: int) -> str:
    return f"bench-a{i:04d}"


def tenant_name(i: int) -> str:
    return f"bench-t{i:03d}"


def tenant_of_adapter(adapter: int, num_tenants: int) -> str:
    return tenant_name(adapter % num_tenants)


def power_index(rng: random.Random, n: int, alpha: float) -> int:
    """floor(n * u), u ~ power(alpha): P(u <= x) = x^alpha, sampled by inversion."""
    u = rng.random() ** (1.0 / alpha)
    return min(int(n * u), n - 1)


def adapter_rng(seed: int) -> random.Random:
    """The stream that assigns requests to adapters, apart from the trace's own."""
    return random.Random(f"{seed}:adapters")


def assign(rng: random.Random, cfg: WorkloadConfig, index: int) -> tuple[int | None, str]:
    """(adapter or None for the base model, tenant) for request `index`, from the adapter stream."""
    base = rng.random() < cfg.base_share
    if base:
        adapter = None
    elif cfg.round_robin:
        adapter = index % cfg.num_adapters
    else:
        adapter = power_index(rng, cfg.num_adapters, cfg.alpha)
    tenant = (tenant_name(rng.randrange(cfg.num_tenants)) if adapter is None
              else tenant_of_adapter(adapter, cfg.num_tenants))
    return adapter, tenant


def generate_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    rng, arng = random.Random(cfg.seed), adapter_rng(cfg.seed)
    shape, scale = 1.0 / (cfg.cv * cfg.cv), cfg.cv * cfg.cv / cfg.rate
    out: list[BenchRequest] = []
    t = 0.0
    for i in range(cfg.total_requests):
        if math.isfinite(cfg.rate):
            t += rng.gammavariate(shape, scale)
        adapter, tenant = assign(arng, cfg, i)
        n_prompt = rng.randint(*cfg.prompt_len)
        prompt = tuple(rng.randrange(*cfg.token_range) for _ in range(n_prompt))
        out.append(BenchRequest(i, t, adapter, tenant, prompt, rng.randint(*cfg.output_len)))
    return out


def generate_conversations(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The prefix workload (see the module's doc), in arrival order."""
    rng, arng = random.Random(cfg.seed), adapter_rng(cfg.seed)
    shape, scale = 1.0 / (cfg.cv * cfg.cv), cfg.cv * cfg.cv / cfg.rate

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*cfg.token_range) for _ in range(n)]

    system = {tenant_name(i): tokens(cfg.shared_prefix_len) for i in range(cfg.num_tenants)}
    turns: list[tuple[float, int, int | None, str, tuple[int, ...], int]] = []
    start = 0.0
    for c in range(math.ceil(cfg.total_requests / cfg.turns)):
        if math.isfinite(cfg.rate):
            start += rng.gammavariate(shape, scale)
        adapter, tenant = assign(arng, cfg, c)
        history = list(system[tenant])
        for turn in range(min(cfg.turns, cfg.total_requests - c * cfg.turns)):
            history += tokens(rng.randint(*cfg.prompt_len))
            max_tokens = rng.randint(*cfg.output_len)
            turns.append((start + turn * cfg.turn_gap_s, turn, adapter, tenant, tuple(history), max_tokens))
            history += tokens(max_tokens)  # the reply, as the client resends it next turn
    turns.sort(key=lambda t: t[0])  # stable: a conversation's turns keep their order
    return [BenchRequest(i, t, adapter, tenant, prompt, max_tokens, turn)
            for i, (t, turn, adapter, tenant, prompt, max_tokens) in enumerate(turns)]


def trace_totals(requests: list[BenchRequest]) -> dict:
    """What a trace asks for, whoever serves it: requests, prompt and output tokens (ignore_eos makes
    the output exactly max_tokens), and a digest of the prompts and lengths in order."""
    h = hashlib.sha256()
    for r in requests:
        h.update(repr((r.prompt_ids, r.max_tokens)).encode())
    return {"requests": len(requests), "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
            "output_tokens": sum(r.max_tokens for r in requests), "digest": h.hexdigest()[:16]}


def check_same_trace(totals: list[dict]) -> None:
    """Every run of a comparison served the same trace; raises naming the first that did not."""
    for t in totals[1:]:
        if t != totals[0]:
            raise AssertionError(f"the runs did not serve the same trace: {totals[0]} vs {t}")


def adapters_used(requests: list[BenchRequest]) -> list[int]:
    return sorted({r.adapter for r in requests if r.adapter is not None})


def tenants_used(requests: list[BenchRequest]) -> list[str]:
    return sorted({r.tenant for r in requests})
