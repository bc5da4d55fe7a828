"""ServerState: the long-lived objects one app owns, built in its lifespan."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import redis

from adapters.dora_scale_store import DoraScaleStore
from adapters.format import PROJECTIONS, ModelShape
from adapters.references import ReferenceStore
from adapters.registry import AdapterRegistry
from adapters.sharing import SharingStore
from adapters.loader_pool import LoaderPool
from adapters.sources import SourcePolicy
from adapters.sources.clients import SourceClients
from server.api.adapter_source import RetirementListener, registry_fetch
from server.api.metrics import Metrics
from server.api.redis_probe import RedisProbe
from server.api.engine_history import EngineHistory
from server.api.fetch_flights import FetchFlights
from server.api.prompts import PromptTokenizer
from server.api.settlement import Settlements
from server.config import ServerConfig
from server.credentials import SOURCE_CREDENTIALS_KEY_FILE, load_or_create_key
from server.demo import DemoPaths
from server.engine import EngineConfig, LLMEngine
from server.engine.config import ModelConfig
from server.engine.async_engine import AsyncEngine
from server.model_source import resolve_model
from server.engine.grammar_worker import GrammarCompileService
from server.embedded_redis.server import EmbeddedRedis
from tenants import AuthThrottle, Limiter, RefusalLog, TenantStore, UsageLog
from tenants.compile_budget import CompileBudget
from tenants.source_credentials import KEY_BYTES, SourceCredentials

log = logging.getLogger(__name__)

REDIS_TIMEOUT_SECONDS = 5.0
# Fetches under way at once without loader processes: each takes the interpreter from the engine thread.
_IN_PROCESS_FETCHES = 4


def cpu_loras_bytes(shape: ModelShape, max_lora_rank: int, itemsize: int, count: int) -> int:
    """vLLM's --max-cpu-loras as a byte budget: room for `count` adapters of the largest rank on all
    seven projections of every layer, in the serving dtype."""
    per_layer = sum(max_lora_rank * sum(shape.in_out(p)) for p in PROJECTIONS)
    return count * shape.num_layers * per_layer * itemsize


def _held_versions(engine: AsyncEngine) -> set[str]:
    """The adapter versions this process holds in any tier (asked on the engine thread; blocking)."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    try:
        engine.post(lambda e: done.set_result(
            set(e.host.entries) | set(e.host.loading) | set(e.host.parked) | set(e.lora_slots.slot_of)))
        return done.result(timeout=30)
    except Exception:  # noqa: BLE001 - a dead or stuck engine holds nothing worth resyncing
        log.warning("could not list the engine's adapter versions for a resync", exc_info=True)
        return set()


@dataclass
class ServerState:
    config: ServerConfig
    model_id: str
    engine: AsyncEngine
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
    prompts: PromptTokenizer
    settlements: Settlements
    history: EngineHistory
    grammar_compiler: GrammarCompileService
    compile_budget: CompileBudget            # each tenant's compile seconds in the rate window
    demo: DemoPaths | None
    embedded_redis: EmbeddedRedis | None

    @classmethod
    def build(cls, config: ServerConfig) -> "ServerState":
        """Blocking (starts Redis, may build the demo model, loads weights): run it off the loop."""
        embedded = None
        client = None
        loaders = pager = None
        try:
            if config.redis_url is None:
                embedded = EmbeddedRedis.start(Path(config.data_dir) / "redis")
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
            if config.adapter_load_workers and (config.adapter_sources or config.lora_modules):
                # Started first: their imports overlap the model's loading. The pager parses stored
                # versions for the host tier and loads local directories, so neither ever queues
                # behind slow remote fetches.
                loaders = LoaderPool(config.adapter_load_workers, config.max_upload_bytes)
                pager = LoaderPool(1, config.max_upload_bytes)
            registry = AdapterRegistry(client, prefix=config.redis_prefix,
                                       grace_seconds=config.adapter_grace_seconds)
            engine_config = EngineConfig(
                model=model_dir, device=config.device, dtype=config.dtype,
                max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                kv_cache_blocks=config.kv_cache_blocks,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_cpu_lora_bytes=config.max_cpu_lora_bytes,
                kernels=config.kernels, seed=config.seed, enforce_eager=config.enforce_eager,
                async_scheduling=config.async_scheduling,
                enable_prefix_caching=config.enable_prefix_caching,
                share_base_prefix_cache=config.share_base_prefix_cache, cpu_threads=config.cpu_threads,
                quantization=config.quantization,
                quantize_lm_head=config.quantize_lm_head, int4_group_size=config.int4_group_size,
                kv_cache_dtype=config.kv_cache_dtype,
                max_mask_fill_seconds=config.max_grammar_mask_ms / 1000,
                max_mask_seconds_per_request=config.max_grammar_mask_seconds)
            engine_config = dataclasses.replace(engine_config, max_prefill_tokens_while_decoding=config.prefill_cap_for(
                engine_config.resolve_device().type))
            shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
            if config.max_cpu_loras is not None:
                itemsize = engine_config.resolve_dtype(ModelConfig.from_dir(model_dir),
                                                       engine_config.resolve_device()).itemsize
                engine_config = dataclasses.replace(engine_config, max_cpu_lora_bytes=cpu_loras_bytes(
                    shape, config.max_lora_rank, itemsize, config.max_cpu_loras))
            engine = LLMEngine(engine_config, registry_fetch(registry, shape, config.max_lora_rank, pager),
                               DoraScaleStore(client, prefix=config.redis_prefix))
            async_engine = AsyncEngine(engine)
            retirements = RetirementListener(client, registry.events_channel, async_engine.remove_adapter_nowait,
                                             held=lambda: _held_versions(async_engine),
                                             retired=registry.retired_versions)
            limiter = Limiter(client, config.redis_prefix, window_seconds=config.rate_window_seconds,
                              lease_seconds=config.lease_ttl, holder=config.replica)
            usage = UsageLog(client, config.redis_prefix)
            for pool in (loaders, pager):
                if pool is not None:
                    pool.wait_ready()
            return cls(
                config=config, model_id=config.model_id, engine=async_engine, redis=client,
                redis_probe=RedisProbe(url),
                tenants=TenantStore(client, config.redis_prefix), limiter=limiter, usage=usage,
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
                prompts=PromptTokenizer(model_dir, engine.max_model_len),
                settlements=Settlements(limiter, usage, config.usage_settle_interval), history=EngineHistory(),
                grammar_compiler=GrammarCompileService(engine.grammars, config.max_grammar_compile_ms),
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
        self.engine.engine.shutdown()
        self.grammar_compiler.shutdown()
        for pool in (self.loaders, self.pager):
            if pool is not None:
                pool.close()
        self.redis_probe.close()
        self.redis.close()
        if self.embedded_redis is not None:
            self.embedded_redis.stop()
