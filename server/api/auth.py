"""Who may call, and what a generation may spend: bearer authentication, then the tenant's quota.

Authentication: bearer tenant API keys for /v1, the admin token for /admin, the metrics token
for /metrics; and the throttle on failed attempts at each.

Failed tenant-key attempts are throttled per client address and per key id (tenants.limits
says why the two differ: an address over the limit is refused before its key is checked, a key
id under attack still admits its right secret). The client address is the connection's peer, or
what a trusted proxy put in X-Forwarded-For (uvicorn's --forwarded-allow-ips, FORWARDED_ALLOW_IPS).

AdminAuthThrottle: failed admin-token and metrics-token attempts throttled per client address,
with the same Redis counters and limit as tenant keys (tenants.limits), so one address that
guesses at either is stopped by one budget, on every replica sharing the Redis.

Pure ASGI around the whole app, for every path that takes the admin or metrics token (`/admin/...`,
`/metrics`): every such route checks its token with `require_admin`/`require_metrics_reader`, so
guarding the paths here covers routes added later without touching them. Only requests that
present a bearer token are counted (a missing token is not a guess), and only their 401s (a tenant
key sent to the admin API gets a 403 and reveals nothing). /metrics also takes its token as an HTTP
Basic password, so Basic credentials count as a presented token too.

- Before the route: an address over the limit gets 429 with Retry-After before its token is
  checked, so past the limit even the right token proves nothing to a guesser there.
- After it: a 401 counts one failure for the address.

Redis errors fail open here: the token is still required, and an operator must be able to reach
`/admin` and `/metrics` while Redis is down to see why.

Quota: a generation request against its tenant's quota, from admission to settlement: the gate before its
body is read, the cost of what it asks checked as a whole, the compile seconds of its constraint,
and the settlement in Redis of its lease, token charge and usage.

A request's admission in two steps: a gate before its body is read, then the charge of what it asks.

Before a byte of the body is read, the tenant is authenticated and takes one request of its rate
and one concurrency slot, charged 0 tokens: an over-quota tenant gets its 429 without its body
being read or parsed, and no tenant has more bodies in flight than its concurrency limit. A
generation hands the gate over once its body is parsed and its prompts are tokenized: each
prompt is then admitted with its real token estimate (all or none, see openai_routes). A request
refused at any point (a 4xx or a 429) is cancelled from the window: it counts in no per-minute
window and is never billed; except a constraint whose compile failed or hit its deadline, which
spent the server's CPU and stays counted as one request (`charged_compile`).

What one generation request may cost, checked as a whole before any of it is admitted.

A request is its prompts x n choices x max_tokens: the tenant's max_tokens_per_request and
tokens_per_minute bound that total (a batch of 64 prompts with n 16 is 1,024 completions, not
one), and the response's size is bounded by --max-logprob-entries, counted as OpenAI's
response would carry them: per prompt, n x (max_tokens + the prompt's tokens when it is echoed
or scored) x (the top alternatives + 1). All are refusals that waiting cannot fix: 400s.

A request's constraint compiled at the tenant's cost: a new constraint is refused (429) once the
tenant spent its --compile-seconds-per-minute, and the seconds a compile process spends on it are
charged whether it compiles, fails or is killed at its deadline. A cached constraint is free.
A failed compile's request also stays counted against requests_per_minute (server.api.openai_routes):
its CPU was spent, so a flood of deadline-hitting schemas is neither free nor unbounded.

Settling requests in Redis (concurrency lease, token charge, usage): while they run, and when
they end, with retries.

While a request runs, a heartbeat thread of this replica beats every lease it holds (every lease
time / 3, all of them in one round trip), so a long request never loses its slot while a crashed
replica's slots come back within the lease time; and a usage thread records each request's usage so
far (every usage-settle interval, all of them in one pipelined round trip), so a crash loses at
most that interval of usage. Each record sends the request's totals so far, and Redis adds only
what it has not recorded of that request (UsageLog.record_so_far), so a record sent again after
a lost reply, and the final one, keep the totals exact. Threads, not tasks on the
event loop: a loop that one request stalls must not cost every other request its lease. Two threads,
not one: recording usage grows with the number of running requests and, under load, each of its
round trips waits for the GIL, so a heartbeat queued behind it came late enough to lose every lease
(48 at once, with nothing wrong with Redis); the heartbeat waits for nothing but its own round trip.

A request that ends while Redis is unreachable must not leak its lease until it expires, nor lose
its usage: the rest of its settlement is queued and retried in the background until Redis
answers again. Retries are bounded in count and age, so a long outage cannot grow the queue
without limit (a lease left behind then expires on its own after the limiter's lease time).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import redis
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError
from server.api.openai_requests import ChatCompletionRequest, CompletionRequest, Constraint, compile_constraint
from tenants import Admission, Limiter, RequestTooLarge, RunUsage, Tenant, UsageLog, check_request_tokens
from tenants.store import parse_key

if TYPE_CHECKING:  # server.api.state builds this module's Settlements, so it imports this module
    from server.api.state import ServerState

log = logging.getLogger(__name__)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def basic_password(request: Request) -> str | None:
    """The password of HTTP Basic credentials (the user name is not read): how scrapers that cannot send a
    bearer token (aiperf's, through a netrc file or a URL's user:password) present the metrics token."""
    scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or len(encoded) > 1024:
        return None
    try:
        _, sep, password = base64.b64decode(encoded.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return password if sep and password else None


def state_of(request: Request) -> ServerState:
    return request.app.state.lp


def _throttled(wait: int, why: str) -> APIError:
    return APIError(429, f"too many failed authentications {why}; retry after {wait} s", "auth_throttled",
                    {"Retry-After": str(wait)})


def _authenticate(state: ServerState, token: str, address: str | None) -> Tenant:
    """Blocking: the throttle check, the key check, and the count of a failure."""
    wait = state.auth_throttle.blocked(address)
    if wait is not None:
        state.metrics.auth_failures.labels("throttled").inc()
        raise _throttled(wait, "from this address")
    tenant = state.tenants.authenticate(token)
    if tenant is not None:
        return tenant
    parsed = parse_key(token)
    wait = state.auth_throttle.failed(address, None if parsed is None else parsed[0])
    if wait is not None:
        state.metrics.auth_failures.labels("throttled").inc()
        raise _throttled(wait, "for this key or from this address")
    state.metrics.auth_failures.labels("invalid").inc()
    raise APIError(401, "invalid API key", "invalid_api_key", _CHALLENGE)


async def require_tenant(request: Request) -> Tenant:
    token = bearer_token(request)
    if token is None:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       "missing_api_key", _CHALLENGE)
    address = request.client.host if request.client is not None else None
    tenant = await run_in_threadpool(_authenticate, state_of(request), token, address)
    # Who a refusal of this request is counted against (server.api.refusal_count).
    request.state.tenant = tenant
    return tenant


def _matches(token: str, expected: str | None) -> bool:
    # Constant time in the token's content; bytes so that any header text compares safely.
    return expected is not None and hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                                                        expected.encode("utf-8"))


def require_admin(request: Request) -> None:
    token = bearer_token(request)
    if token is None:
        raise APIError(401, "missing admin token: send 'Authorization: Bearer <admin token>'",
                       "missing_api_key", _CHALLENGE)
    if not _matches(token, state_of(request).config.admin_token):
        if parse_key(token) is not None:
            raise APIError(403, "tenant API keys cannot use the admin API", "forbidden")
        raise APIError(401, "invalid admin token", "invalid_api_key", _CHALLENGE)


def require_metrics_reader(request: Request) -> None:
    """/metrics names tenants: the admin token or the metrics token, unless --metrics-public."""
    config = state_of(request).config
    if config.metrics_public:
        return
    token = bearer_token(request) or basic_password(request)
    if token is None:
        raise APIError(401, "missing token: /metrics needs 'Authorization: Bearer <admin or metrics token>' (or "
                            "HTTP Basic credentials with that token as the password)",
                       "missing_api_key", _CHALLENGE)
    admin_ok = _matches(token, config.admin_token)
    metrics_ok = _matches(token, config.metrics_token)
    if not (admin_ok or metrics_ok):
        if parse_key(token) is not None:
            raise APIError(403, "tenant API keys cannot read /metrics", "forbidden")
        raise APIError(401, "invalid token for /metrics", "invalid_api_key", _CHALLENGE)


def _guarded(path: str) -> bool:
    return path == "/metrics" or path.startswith("/admin/")


def _presents_credentials(scope: Scope) -> bool:
    """A bearer token, or HTTP Basic credentials (/metrics takes its token as a Basic password)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return value[:7].lower() == b"bearer " or value[:6].lower() == b"basic "
    return False


class AdminAuthThrottle:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _guarded(scope["path"]) or not _presents_credentials(scope):
            await self.app(scope, receive, send)
            return
        state = scope["app"].state.lp
        client = scope.get("client")
        address = client[0] if client else None
        try:
            wait = await run_in_threadpool(state.auth_throttle.blocked, address)
        except redis.RedisError as exc:
            log.warning("admin auth throttle unavailable (%s); checking the token alone", exc)
            wait = None
        if wait is not None:
            state.metrics.auth_failures.labels("throttled").inc()
            error = APIError(429, f"too many failed authentications from this address; retry after {wait} s",
                             "auth_throttled", {"Retry-After": str(wait)})
            await error.response()(scope, receive, send)
            return

        async def watch(message: Message) -> None:
            # A failure is counted before its 401 is sent: counted after, a client's next guess could be
            # checked before this one was counted, and a guess or more would go free.
            if message["type"] == "http.response.start" and message["status"] == 401:
                state.metrics.auth_failures.labels("invalid").inc()
                try:
                    await run_in_threadpool(state.auth_throttle.failed, address, None)
                except redis.RedisError as exc:
                    log.warning("admin auth failure not counted (%s)", exc)
            await send(message)

        await self.app(scope, receive, watch)


async def cancel_admission(state: ServerState, admission: Admission) -> None:
    """Undo an admission as if it had never been granted (shielded: a disconnect must not skip it): its
    lease is no longer beaten and nothing of it is recorded."""
    state.settlements.discard(admission)
    with anyio.CancelScope(shield=True):
        try:
            await run_in_threadpool(state.limiter.cancel, admission)
        except redis.RedisError as e:
            # The charge leaves the window and the lease expires on their own; nothing is billed.
            log.warning("cancelling the admission of %s failed (%r)", admission.request_id, e)


async def keep_admission(state: ServerState, admission: Admission) -> None:
    """End an admission that stays counted in the window (one request, 0 tokens): a request that
    succeeded as itself, or one refused after it cost the server work (a failed compile)."""
    state.settlements.discard(admission)
    with anyio.CancelScope(shield=True):
        try:
            await run_in_threadpool(state.limiter.release, admission, 0)
        except redis.RedisError as e:
            log.warning("releasing the admission of %s failed (%r); its lease will expire",
                        admission.request_id, e)


class Gate:
    """One request of the tenant's rate and one concurrency slot, held while the body is read."""

    def __init__(self, state: ServerState, admission: Admission) -> None:
        self._state = state
        self._admission = admission
        self._open = True

    async def hand_over(self) -> None:
        """Give the slot back before the request's own admissions take theirs (idempotent)."""
        if self._open:
            self._open = False
            await cancel_admission(self._state, self._admission)

    async def finish(self) -> None:
        """The request succeeded as itself (tokenize, detokenize): it stays counted in the window."""
        if self._open:
            self._open = False
            await keep_admission(self._state, self._admission)


@contextlib.asynccontextmanager
async def gated(state: ServerState, tenant: Tenant) -> AsyncIterator[Gate]:
    """Admit the tenant's request before its body is read; cancelled if the block raises
    (the request was refused), kept in the window if it ends normally."""
    admission = await run_in_threadpool(state.limiter.admit, tenant, "gate-" + uuid.uuid4().hex, 0)
    gate = Gate(state, admission)
    try:
        yield gate
    except BaseException:
        await gate.hand_over()
        raise
    await gate.finish()


def _top(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per returned position; None when the response carries no logprobs."""
    if isinstance(req, CompletionRequest):
        asked = [v for v in (req.logprobs, req.prompt_logprobs) if v is not None]
    else:
        asked = [v for v in ((req.top_logprobs or 0) if req.logprobs else None, req.prompt_logprobs)
                 if v is not None]
    return max(asked) if asked else None


def logprob_entries(req: CompletionRequest | ChatCompletionRequest, prompt_lens: Sequence[int],
                    max_tokens: Sequence[int]) -> int:
    """Positions x (alternatives + 1) the response may carry; echoed prompts count as positions.
    0 for a response with neither logprobs nor an echo."""
    top = _top(req)
    echo = isinstance(req, CompletionRequest) and req.echo
    if top is None and not echo:
        return 0
    with_prompt = echo or req.prompt_logprobs is not None
    return sum(req.n * (m + (p if with_prompt else 0)) * ((top or 0) + 1) for p, m in zip(prompt_lens, max_tokens))


def _completion_tokens(prompts: int, n: int) -> str:
    return f"the request's completion tokens (prompts {prompts} x n {n} x max_tokens)"


def check_completion_cap(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, prompts: int) -> None:
    """The tenant's max_tokens_per_request before any prompt is tokenized, where the total does not
    depend on the prompts (a completion with max_tokens): a batch past the cap costs the server no
    tokenizing (64 prompts of text: 64 tokenizer calls, each a worker-thread hop). check_request_cost
    checks every request again once its prompts are known."""
    if isinstance(req, CompletionRequest) and req.max_tokens is not None:
        check_request_tokens(tenant, prompts * req.n * req.max_tokens, _completion_tokens(prompts, req.n))


def check_request_cost(req: CompletionRequest | ChatCompletionRequest, tenant: Tenant, prompt_lens: Sequence[int],
                       max_tokens: Sequence[int], max_logprob_entries: int) -> None:
    """400 for a request that can never be served within the tenant's per-request and per-minute
    token limits or the server's response budget."""
    completion = sum(req.n * m for m in max_tokens)
    check_request_tokens(tenant, completion, _completion_tokens(len(prompt_lens), req.n))
    tpm = tenant.quota.tokens_per_minute
    total = sum(prompt_lens) + completion
    if tpm is not None and total > tpm:
        raise RequestTooLarge(
            f"this request may use up to {total} tokens (its prompts' {sum(prompt_lens)} plus prompts x n x "
            f"max_tokens = {completion}), more than the tenant's tokens_per_minute of {tpm}; "
            f"send fewer prompts, a smaller n or max_tokens", "tokens_per_minute")
    entries = logprob_entries(req, prompt_lens, max_tokens)
    if entries > max_logprob_entries:
        raise APIError(400, f"this request may return up to {entries} logprob entries (prompts x n x (max_tokens "
                            f"+ prompt tokens when echoed or with prompt_logprobs) x (logprobs + 1)); the server's "
                            f"limit is {max_logprob_entries} (--max-logprob-entries): send fewer prompts, a smaller "
                            f"n, max_tokens or logprobs", "max_logprob_entries", param="logprobs")


async def charged_compile(state: ServerState, tenant: Tenant, constraint: Constraint):
    compiler = state.grammar_compiler
    cached = compiler.grammars.lookup(constraint.spec)
    if cached is not None:
        return cached
    limit = state.config.compile_seconds_per_minute
    if limit:
        await run_in_threadpool(state.compile_budget.check, tenant, limit)
    spent: list[float] = []
    try:
        return await compile_constraint(compiler, constraint, tenant.id, spent.append)
    finally:
        if spent:
            with anyio.CancelScope(shield=True):  # a client that leaves was charged all the same
                try:
                    await run_in_threadpool(state.compile_budget.charge, tenant.id, sum(spent))
                except redis.RedisError as e:
                    log.warning("charging tenant %r %.2f s of compiles failed (%r)", tenant.name, sum(spent), e)


MAX_PENDING = 100_000
MAX_AGE_SECONDS = 3600.0
RETRY_INTERVAL_SECONDS = 0.5
# At exit, how long the requests the stop cut may take to settle before Redis is closed under them.
SETTLE_AT_EXIT_SECONDS = 5.0
# Beats per lease time: two may fail (or come late) before a live request's lease lapses. A beat
# is one round trip (per 500 leases), so with the default 10 s lease a beat may come 6.7 s late.
BEATS_PER_LEASE = 3
# Running requests whose usage goes in one pipelined round trip (and whose locks it holds meanwhile).
RECORD_BATCH = 500


@dataclass(frozen=True)
class Usage:
    """Counters for the usage log: a request's whole usage, or the part not yet recorded."""

    requests: int
    prompt_tokens: int
    completion_tokens: int

    def minus(self, recorded: "Usage") -> "Usage":
        # Counts only grow while a request runs, so the part not yet recorded is never negative.
        delta = Usage(self.requests - recorded.requests, self.prompt_tokens - recorded.prompt_tokens,
                      self.completion_tokens - recorded.completion_tokens)
        assert min(delta.requests, delta.prompt_tokens, delta.completion_tokens) >= 0, (self, recorded)
        return delta

    def __bool__(self) -> bool:
        return bool(self.requests or self.prompt_tokens or self.completion_tokens)


NOTHING = Usage(0, 0, 0)


class _Running:
    """A request admitted on this replica and not yet settled: what was recorded of it so far.
    `lock` orders the usage thread's incremental records against the final one."""

    __slots__ = ("tenant", "admission", "prompt_tokens", "adapter", "progress", "recorded", "closed", "lock",
                 "opened")

    def __init__(self, tenant: Tenant, admission: Admission, prompt_tokens: int, adapter: str | None) -> None:
        self.tenant = tenant
        self.admission = admission
        self.prompt_tokens = prompt_tokens
        self.adapter = adapter
        self.progress: Callable[[], int] | None = None   # completion tokens delivered so far
        self.recorded = NOTHING
        self.closed = False
        self.lock = threading.Lock()
        self.opened = time.monotonic()   # about when its lease was granted


@dataclass(frozen=True)
class Settlement:
    tenant: Tenant
    admission: Admission
    charged_tokens: int     # the request's actual tokens, for the limiter's window
    usage: Usage            # the request's whole usage (the usage log adds what it lacks of it)
    adapter: str | None     # the adapter's name, None for the base model
    created: float


def _run_usage(tenant: Tenant, admission: Admission, so_far: Usage, adapter: str | None) -> RunUsage:
    return RunUsage(tenant, admission.slot_id, so_far.prompt_tokens, so_far.completion_tokens, so_far.requests,
                    adapter)


class Settlements:
    def __init__(self, limiter: Limiter, usage: UsageLog, settle_interval: float = 2.0) -> None:
        if not settle_interval > 0:
            raise ValueError(f"settle_interval must be > 0, got {settle_interval!r}")
        self._limiter = limiter
        self._usage = usage
        self.settle_interval = float(settle_interval)
        self.beat_interval = limiter.lease_seconds / BEATS_PER_LEASE
        self._pending: deque[tuple[Settlement, bool]] = deque()  # (what, lease already released)
        self._running: dict[str, _Running] = {}                  # slot id -> request
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Settles under way, and whether stop() has closed the door on new ones: once it has, the
        # caller closes the Redis client, and a pipeline still reading from it fails outside RedisError.
        self._settling = 0
        self._closed = False
        self._idle = threading.Condition()
        self.dropped = 0
        self.leases_lost = 0
        # The longest a running request's lease went unrenewed (s): from its grant or the heartbeat
        # before, to the heartbeat that renewed it. A lease lapses past the limiter's lease time.
        self.longest_beat_gap = 0.0
        self.beats = 0  # heartbeats that renewed at least one lease
        self._last_beat: float | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def running(self) -> int:
        return len(self._running)

    # ---- while a request runs ------------------------------------------

    def open(self, tenant: Tenant, admission: Admission, prompt_tokens: int, adapter: str | None = None) -> None:
        """From admission on, the heartbeat thread beats this request's lease."""
        self._running[admission.slot_id] = _Running(tenant, admission, prompt_tokens, adapter)

    def discard(self, admission: Admission) -> None:
        """Forget a request refused before it was followed (its batch was refused as a whole): its lease
        is no longer beaten, and nothing of it was or will be recorded."""
        running = self._running.pop(admission.slot_id, None)
        if running is not None:
            with running.lock:
                running.closed = True
                assert not running.recorded, (admission.request_id, running.recorded)
        with self._idle:
            self._idle.notify_all()  # stop() may be waiting for the open requests to go

    def follow(self, admission: Admission, progress: Callable[[], int]) -> None:
        """From now on the usage thread records the request's usage so far: the request and its prompt,
        and `progress()` completion tokens (thread-safe to call; it only grows)."""
        running = self._running.get(admission.slot_id)
        if running is not None:
            running.progress = progress

    def beat(self) -> None:
        """One heartbeat of every running request's lease (blocking; raises RedisError)."""
        running = list(self._running.values())
        # Read before the renewal is sent: read after, a thread that waits for the GIL once the reply is in
        # (a loaded host) would count that wait as a gap, though the leases were renewed before it.
        now = time.monotonic()
        if running:
            lost = [a for a in self._limiter.renew([r.admission for r in running]) if a.slot_id in self._running]
            if lost:
                # Only after this replica went unheard for a lease time (a Redis outage, a frozen host).
                self.leases_lost += len(lost)
                log.warning("%d running requests lost their concurrency leases (unheard for %.0f s)",
                            len(lost), self._limiter.lease_seconds)
            self.beats += 1
            # The lease renewed last longest ago: granted, or renewed by the previous heartbeat.
            oldest = min(r.opened for r in running)
            since = oldest if self._last_beat is None else max(self._last_beat, oldest)
            self.longest_beat_gap = max(self.longest_beat_gap, now - since)
        self._last_beat = now

    def record_progress(self) -> None:
        """Record every followed request's usage since the last record (blocking), one pipelined
        round trip per RECORD_BATCH requests. A Redis fault ends the round; the next one records
        the larger deltas."""
        running = list(self._running.values())
        for start in range(0, len(running), RECORD_BATCH):
            if not self._record_batch(running[start:start + RECORD_BATCH]):
                return

    def _record_batch(self, batch: Sequence[_Running]) -> bool:
        """False when Redis failed. Holds the batch's locks until its deltas are written, so that
        settle() sees either none or all of a delta as recorded."""
        held: list[_Running] = []
        try:
            due: list[tuple[_Running, Usage, Usage]] = []   # (request, usage so far, what is new)
            for running in batch:
                running.lock.acquire()
                held.append(running)
                if running.closed or running.progress is None:
                    continue
                so_far = Usage(1, running.prompt_tokens, running.progress())
                delta = so_far.minus(running.recorded)
                if delta:
                    due.append((running, so_far, delta))
            if not due:
                return True
            try:
                self._usage.record_so_far([_run_usage(r.tenant, r.admission, so_far, r.adapter)
                                           for r, so_far, _ in due])
            except redis.RedisError as e:
                # Redis is most likely away for every request: leave them all to the next round.
                log.warning("recording the usage of %d running requests failed (%r); next round", len(due), e)
                return False
            for running, so_far, _ in due:
                running.recorded = so_far
            return True
        finally:
            for running in held:
                running.lock.release()

    def start(self) -> None:
        self._stop.clear()
        with self._idle:
            self._closed = False
        self._last_beat = None
        self._threads = [
            threading.Thread(target=self._every, args=(self.beat_interval, self.beat, "lease heartbeat"),
                             name="loraplex-lease-heartbeat", daemon=True),
            threading.Thread(target=self._every, args=(self.settle_interval, self.record_progress, "usage record"),
                             name="loraplex-usage-keeper", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop(self, grace: float = 0.0) -> None:
        """Stop both threads after a last record of whatever still runs (the replica is exiting).
        Waits up to `grace` seconds for the requests still open to settle first (those the server's
        stop cut settle from their own cleanup, in worker threads, while it exits). On return no
        settle is under way and later ones touch no Redis: the caller may close the client."""
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        self._threads = []
        with self._idle:
            self._idle.wait_for(lambda: not self._running and not self._settling, timeout=grace)
        try:
            self.record_progress()
            self.retry_pending()
        except redis.RedisError:
            log.warning("could not record the usage of running requests at exit", exc_info=True)
        with self._idle:
            self._closed = True
            if not self._idle.wait_for(lambda: not self._settling, timeout=SETTLE_AT_EXIT_SECONDS):
                log.warning("%d settlements still under way at exit", self._settling)

    def _every(self, interval: float, work: Callable[[], None], what: str) -> None:
        """Run `work` every `interval` seconds, counted from the start of each run (a slow round is
        not followed by a full interval of silence), until stop()."""
        due = time.monotonic()
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            due = time.monotonic() + interval
            try:
                work()
            except redis.RedisError as e:
                log.warning("%s failed (%r); next round", what, e)
            except Exception:  # noqa: BLE001 - a bug here must not end the heartbeat of every lease
                log.exception("%s round failed", what)

    # ---- when a request ends -------------------------------------------

    def settle(self, tenant: Tenant, admission: Admission, prompt_tokens: int, completion_tokens: int,
               adapter: str | None = None) -> None:
        """Blocking; never raises for a Redis fault (the settlement is queued instead). The usage log
        adds only what the usage thread has not recorded of the request, so the totals are exact.
        After stop() it records nothing: the last record had the request's usage up to then, and its
        lease lapses by itself."""
        whole = Usage(1, prompt_tokens, completion_tokens)
        running = self._running.pop(admission.slot_id, None)
        if running is not None:
            with running.lock:   # after the usage thread's round that holds it, if any
                running.closed = True
        with self._idle:
            if self._closed:
                log.info("request %s ended after the usage record at exit; its lease lapses by itself",
                         admission.request_id)
                return
            self._settling += 1
        try:
            item = Settlement(tenant, admission, prompt_tokens + completion_tokens, whole, adapter,
                              time.monotonic())
            done = self._try(item, released=False)
            if done is not True:
                if len(self._pending) >= MAX_PENDING:
                    self.dropped += 1
                    log.error("settlement queue full; dropping usage of request %s", admission.request_id)
                    return
                self._pending.append((item, done == "released"))
        finally:
            with self._idle:
                self._settling -= 1
                self._idle.notify_all()

    def _try(self, item: Settlement, released: bool) -> bool | str:
        """True when fully settled, "released" when only the lease went back, False when nothing did."""
        try:
            if not released:
                self._limiter.release(item.admission, item.charged_tokens)
                released = True
            self._usage.record_so_far([_run_usage(item.tenant, item.admission, item.usage, item.adapter)], final=True)
            return True
        except redis.RedisError as e:
            log.warning("settling request %s failed (%r); will retry", item.admission.request_id, e)
            return "released" if released else False

    def retry_pending(self) -> None:
        """One pass over the queue, oldest first; stops at the first item Redis still refuses."""
        now = time.monotonic()
        while self._pending:
            item, released = self._pending[0]
            if now - item.created > MAX_AGE_SECONDS:
                self._pending.popleft()
                self.dropped += 1
                continue
            done = self._try(item, released)
            if done is not True:
                self._pending[0] = (item, done == "released")
                return
            self._pending.popleft()

    async def run(self) -> None:
        """The background retry loop (cancel it to stop)."""
        while True:
            await asyncio.sleep(RETRY_INTERVAL_SECONDS)
            if self._pending:
                await run_in_threadpool(self.retry_pending)
