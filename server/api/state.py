"""ServerState: the long-lived objects one app owns, built in its lifespan."""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import redis

from adapters.format import ModelShape
from adapters.loader_pool import LoaderPool
from adapters.references import ReferenceStore
from adapters.registry import AdapterRegistry
from adapters.sharing import SharingStore
from adapters.sources import SourcePolicy
from adapters.sources.clients import SourceClients
from server.api.adapter_source import RetirementListener
from server.api.base_identity import base_identity
from server.api.engine_watch import EngineHistory
from server.api.fetch_flights import FetchFlights
from server.api.metrics import Metrics
from server.api.prompts import PromptTokenizer
from server.api.auth import Settlements
from server.api.redis_probe import RedisProbe
from server.api.store_tally import StoreTallies
from server.config import ServerConfig
from server.credentials import SOURCE_CREDENTIALS_KEY_FILE, load_or_create_key
from server.demo import DemoPaths
from server.embedded_redis import DATA_SUBDIR
from server.embedded_redis.server import EmbeddedRedis
from server.engine.grammar_worker import GrammarCompileService
from server.engine.protocol import EngineClient
from server.engine_mode import CoreStarter, build_engine_client
from server.model_source import resolve_model
from tenants import AuthThrottle, Limiter, RefusalLog, TenantStore, UsageLog
from tenants.limits import CompileBudget
from tenants.source_credentials import KEY_BYTES, SourceCredentials

log = logging.getLogger(__name__)

REDIS_TIMEOUT_SECONDS = 5.0
# Fetches under way at once without loader processes: each takes the interpreter from the engine thread.
_IN_PROCESS_FETCHES = 4


def _held_versions(engine: EngineClient) -> set[str]:
    """The adapter versions this process holds in any tier (blocking)."""
    try:
        return engine.held_adapter_versions(timeout=30)
    except Exception:  # noqa: BLE001 - a dead or stuck engine holds nothing worth resyncing
        log.warning("could not list the engine's adapter versions for a resync", exc_info=True)
        return set()


@dataclass
class ServerState:
    config: ServerConfig
    model_id: str
    base: str                                # the served base's identity (server.api.base_identity)
    engine: EngineClient
    redis: redis.Redis
    redis_probe: RedisProbe                  # /health's own short-timeout view of Redis
    tenants: TenantStore
    limiter: Limiter
    auth_throttle: AuthThrottle
    source_credentials: SourceCredentials    # tenants' own credentials for adapter sources
    usage: UsageLog
    refusals: RefusalLog
    registry: AdapterRegistry
    references: ReferenceStore
    sharing: SharingStore
    sources: SourcePolicy
    fetches: FetchFlights
    source_clients: SourceClients
    loaders: LoaderPool | None               # loader processes for adapters from sources (None: in-process)
    pager: LoaderPool | None                 # the loader process for stored versions (host tier) and local directories
    retirements: RetirementListener
    metrics: Metrics
    store_tallies: StoreTallies              # the store tier's size, counted at most once a minute
    prompts: PromptTokenizer
    settlements: Settlements
    history: EngineHistory
    grammar_compiler: GrammarCompileService
    compile_budget: CompileBudget            # each tenant's compile seconds in the rate window
    demo: DemoPaths | None
    embedded_redis: EmbeddedRedis | None

    @classmethod
    def build(cls, config: ServerConfig, starter: CoreStarter) -> "ServerState":
        """Blocking (starts Redis, may build the demo model, loads weights): run it off the loop.
        `starter`: how engine cores start (--engine-process separate), the caller's to close."""
        embedded = None
        client = None
        loaders = pager = None
        try:
            if config.redis_url is None:
                embedded = EmbeddedRedis.start(Path(config.data_dir) / DATA_SUBDIR)
                url = embedded.url
            else:
                url = config.redis_url
            # decode_responses=False: the registry stores binary chunks. Timeouts bound how long a
            # request (or an adapter load) can hang on a Redis that stopped answering: it gets a 503.
            client = redis.Redis.from_url(url, decode_responses=False, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                          socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                                          health_check_interval=30)
            client.ping()
            resolved = resolve_model(config.model, Path(config.data_dir), log.info)  # done once by the CLI
            demo, model_dir = resolved.demo, str(resolved.model_dir)
            # Compile and loader processes on the front end side's cores (server.cpu_placement).
            child_cpus = config.cpu_placement.api if config.cpu_placement is not None else None
            if config.uses_loader_processes:
                # Started first: their imports overlap the model's loading. The pager parses stored
                # versions for the host tier and loads local directories, so neither ever queues
                # behind slow remote fetches.
                loaders = LoaderPool(config.adapter_load_workers, config.max_upload_bytes, cpus=child_cpus)
                pager = LoaderPool(1, config.max_upload_bytes, cpus=child_cpus)
            registry = AdapterRegistry(client, prefix=config.redis_prefix,
                                       grace_seconds=config.adapter_grace_seconds)
            hf_config = json.loads((Path(model_dir) / "config.json").read_text())
            shape = dataclasses.replace(ModelShape.from_hf_config(hf_config),
                                        max_vocab_bytes=config.engine.lora.max_lora_vocab_bytes)
            engine = build_engine_client(config, config.engine_for(model_dir), url, shape, registry,
                                         pager, client, starter)
            retirements = RetirementListener(client, registry.events_channel, engine.remove_adapter_nowait,
                                             held=lambda: _held_versions(engine),
                                             retired=registry.retired_versions)
            limiter = Limiter(client, config.redis_prefix, window_seconds=config.rate_window_seconds,
                              lease_seconds=config.lease_ttl, holder=config.replica)
            usage = UsageLog(client, config.redis_prefix)
            for pool in (loaders, pager):
                if pool is not None:
                    pool.wait_ready()
            tenants = TenantStore(client, config.redis_prefix)
            return cls(
                config=config, model_id=config.model_id,
                base=base_identity(config.model_id, engine.info.model_config), engine=engine, redis=client,
                redis_probe=RedisProbe(url),
                tenants=tenants, limiter=limiter, usage=usage,
                refusals=RefusalLog(client, config.redis_prefix),
                auth_throttle=AuthThrottle(client, config.redis_prefix, limit=config.auth_failure_limit,
                                           window_seconds=config.auth_failure_window_seconds),
                source_credentials=SourceCredentials(client, load_or_create_key(
                    config.source_credentials_key_file or config.data_dir / SOURCE_CREDENTIALS_KEY_FILE,
                    KEY_BYTES), config.redis_prefix),
                registry=registry, references=ReferenceStore(client, config.redis_prefix),
                sharing=SharingStore(client, config.redis_prefix), sources=config.source_policy(),
                fetches=FetchFlights(config.adapter_load_workers or _IN_PROCESS_FETCHES, config.adapter_loads_per_tenant,
                                     near_concurrent=1 if pager is not None else _IN_PROCESS_FETCHES),
                source_clients=SourceClients(), loaders=loaders, pager=pager, retirements=retirements, metrics=Metrics(),
                store_tallies=StoreTallies(registry, tenants),
                prompts=PromptTokenizer(model_dir, engine.info.max_model_len, config.chat_template_text()),
                settlements=Settlements(limiter, usage, config.usage_settle_interval), history=EngineHistory(),
                grammar_compiler=engine.grammar_compiler(config.max_grammar_compile_ms, cpus=child_cpus),
                compile_budget=CompileBudget(client, config.redis_prefix, config.rate_window_seconds), demo=demo,
                embedded_redis=embedded)
        except BaseException:
            for pool in (loaders, pager):
                if pool is not None:
                    pool.close()
            if client is not None:
                client.close()
            if embedded is not None:
                embedded.stop()
            raise

    def close(self) -> None:
        self.retirements.stop()
        self.engine.shutdown()
        self.grammar_compiler.shutdown()
        for pool in (self.loaders, self.pager):
            if pool is not None:
                pool.close()
        self.redis_probe.close()
        self.redis.close()
        if self.embedded_redis is not None:
            self.embedded_redis.stop()
