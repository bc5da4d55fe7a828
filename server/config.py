"""ServerConfig: everything `loraplex serve` was told, resolved and validated once."""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
from collections import Counter
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from server.chat_templates import resolve_chat_template
from server.credentials import ADMIN_TOKEN_FILE, load_or_create_secret
# The engine's settings: torch-free (server.engine.config imports no torch).
from server.engine.config import AUTO_PREFILL_CAP, EngineConfig, setting_names

if TYPE_CHECKING:
    from server.cpu_placement import CpuPlacement

_ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A replica name goes into a response header and a Prometheus label: plain ASCII, no spaces.
# tenants.models.TENANT_NAME_RE, repeated: the CLI's config imports nothing that pulls in Redis.
_TENANT_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_REPLICA_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
DEMO_MODEL_NAME = "loraplex-demo"
# --engine-process: an engine-core process of its own (server.engine.core, the default), or the engine's
# step loop on a thread here (the LLM API's way, and tests that read the engine's objects).
ENGINE_PROCESSES = ("in-process", "separate")
DATA_PARALLEL_ROUTINGS = ("affinity", "round-robin")
ENGINE_RESTART_WINDOW_S = 60.0  # --engine-restart-limit counts the restarts within this window
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # --tool-call-parser: server.api.tool_parsers
DEMO_MODEL_FLAG = "demo"  # --model demo: the built-in random-weight model
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # no --model: server.default_model
# Where the CLI's defaults differ from the engine's (docs/cli.md): 8 adapter slots rather than sized from
# memory, a 1 GiB host tier rather than unbounded, and the prefill cap by device type rather than off.
SERVE_ENGINE_DEFAULTS: Mapping[str, Any] = {"max_loras": 8, "max_cpu_lora_bytes": 1 << 30,
                                            "max_prefill_tokens_while_decoding": AUTO_PREFILL_CAP}
# Engine settings the CLI words otherwise: the flag each is given by (the rest: --name-with-dashes).
_FLAG_OF_SETTING = {"max_mask_fill_seconds": "--max-grammar-mask-ms",
                    "max_mask_seconds_per_request": "--max-grammar-mask-seconds", "cpu_affinity": "--engine-cpus"}


class ConfigError(ValueError):
    """A flag or environment value that cannot work; the message names it."""


def default_data_dir(env: Mapping[str, str]) -> Path:
    """$LORAPLEX_DATA_DIR, else $XDG_DATA_HOME/loraplex, else ~/.local/share/loraplex."""
    if env.get("LORAPLEX_DATA_DIR"):
        return Path(env["LORAPLEX_DATA_DIR"]).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "loraplex"


def data_dir_of(args, env: Mapping[str, str]) -> Path:
    """`serve`'s --data-dir, else the default."""
    return Path(args.data_dir).expanduser() if args.data_dir else default_data_dir(env)


def redis_url_of(args, env: Mapping[str, str]) -> str | None:
    """`serve`'s --redis-url or $LORAPLEX_REDIS_URL; None: the embedded Redis."""
    return args.redis_url or env.get("LORAPLEX_REDIS_URL") or None


def valid_adapter_name(name: str) -> bool:
    return _ADAPTER_NAME_RE.fullmatch(name) is not None
def parse_lora_module(value: str) -> tuple[str, str]:
    """vLLM's `--lora-modules` item: `NAME=PATH` or `{"name": ..., "path": ..., "base_model_name": ...}`
    -> (name, path). The base model name, when given, must be the served model (checked by the caller)."""
    text = value.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except ValueError:
            raise ConfigError(f"--lora-modules: {value!r} is not valid JSON") from None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not isinstance(item.get("path"), str) or set(item) - {"name", "path", "base_model_name"}:
            raise ConfigError(f"--lora-modules: {value!r}: give \"name\" and \"path\" (and optionally "
                              "\"base_model_name\")")
        name, path = item["name"], item["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ConfigError(f"--lora-modules expects NAME=PATH or a JSON object, got {value!r}")
    if not _ADAPTER_NAME_RE.fullmatch(name) or not path:
        raise ConfigError(f"--lora-modules {value!r}: name 1-64 characters from A-Z a-z 0-9 . _ -, and a path")
    return name, path


def _lora_module_base(value: str) -> str | None:
    text = value.strip()
    return json.loads(text).get("base_model_name") if text.startswith("{") else None


def parse_adapter_flag(value: str) -> tuple[str | None, str, str]:
    """`[TENANT/]NAME=DIR` -> (tenant or None for the default owner, name, dir)."""
    owned, sep, path = value.partition("=")
    if not sep or not path:
        raise ConfigError(f"--adapter expects [TENANT/]NAME=DIR, got {value!r}")
    return (*_owned_name(owned, "--adapter"), path)


def parse_pin_flag(value: str) -> tuple[str | None, str]:
    """--pin-adapter's `[TENANT/]NAME` -> (tenant or None for the default owner, name)."""
    return _owned_name(value, "--pin-adapter")


def _owned_name(owned: str, flag: str) -> tuple[str | None, str]:
    tenant, slash, name = owned.rpartition("/")
    if slash and not _TENANT_NAME_RE.fullmatch(tenant):
        raise ConfigError(f"{flag} tenant {tenant!r}: use 1-63 characters from a-z 0-9 _ -, starting with a "
                          f"letter or digit")
    if not valid_adapter_name(name):
        raise ConfigError(f"{flag} name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -")
    return (tenant if slash else None), name


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path
    admin_token: str
    admin_token_generated: bool = False   # kept in data_dir/admin-token and printed at start when True
    model: str | None = None              # None: the default real model; "demo": the demo model under data_dir
    served_model_name: str | None = None
    redis_url: str | None = None          # None: an embedded redis-server under data_dir
    # The engine's settings (server.engine.config), the CLI's defaults where they differ from the engine's;
    # its model is set at start, when --model is resolved to a checkpoint directory (ServerConfig.engine_for).
    engine: EngineConfig = field(default_factory=lambda: EngineConfig.of(**SERVE_ENGINE_DEFAULTS))
    host: str = "127.0.0.1"
    port: int = 8000
    adapters: tuple[tuple[str | None, str, str], ...] = ()  # --adapter: (tenant or None: the default owner, name, dir)
    pin_adapters: tuple[tuple[str | None, str], ...] = ()  # --pin-adapter: (tenant or None: the default owner, name)
    # --engine-process: the engine in an engine-core process of its own (server.engine.core), or in this
    # process's step-loop thread; ENGINE_PROCESSES.
    engine_process: str = "separate"
    # --engine-restart / --engine-restart-limit (separate only): a dead engine core is started again
    # unless engine_restart_limit restarts happened within ENGINE_RESTART_WINDOW_S; then the server exits 1.
    engine_restart: bool = True
    engine_restart_limit: int = 3
    # --api-server-count: front-end processes sharing the port and the engine core(s) (server.front_ends).
    api_server_count: int = 1
    # --data-parallel-size / --data-parallel-routing: engine-core processes behind the front end, each on
    # its share of the engine's cores (server.engine.data_parallel); DATA_PARALLEL_ROUTINGS.
    data_parallel_size: int = 1
    data_parallel_routing: str = "affinity"
    # Set by the parent of several front ends in each one it spawns: which one this is (0 runs the
    # start-up writes and the store's upkeep) and the input socket of each engine core it runs (one, or
    # --data-parallel-size of them) to attach to.
    front_end_index: int = 0
    engine_addresses: tuple[str, ...] = ()
    # --engine-cpus / --api-cpus resolved (server.cpu_placement): the cores of each side, applied by
    # `loraplex serve`; None: nothing pinned (one core, or a ServerConfig built in code, e.g. by tests).
    cpu_placement: "CpuPlacement | None" = None
    max_upload_bytes: int = 512 << 20     # hard cap on an adapter upload body
    max_request_bytes: int = 16 << 20     # hard cap on a JSON request body (--max-request-bytes)
    max_batch_prompts: int = 64           # prompts in one /v1/completions batch (--max-batch-prompts)
    max_logprob_entries: int = 1 << 16    # logprob entries one response may carry (--max-logprob-entries)
    # How long a stop (SIGTERM, Ctrl-C) lets running requests finish before it cuts them (--shutdown-timeout);
    # Kubernetes' default grace period: a replica being drained finishes its streams.
    shutdown_timeout: float = 30.0
    max_grammar_compile_ms: int = 5000    # a structured-output constraint's compile deadline (killed past it)
    max_schema_bytes: int = 64 << 10      # largest structured-output constraint (schema, regex, grammar)
    compile_seconds_per_minute: float = 30.0  # one tenant's compile-process seconds per rate window (0: no limit)
    tool_call_parser: str = "hermes"      # --tool-call-parser: how tool_choice auto reads the model's calls
    enable_auto_tool_choice: bool = True  # --[no-]enable-auto-tool-choice: off, tool_choice auto is a 400 (vLLM's default)
    chat_template: str | None = None      # --chat-template: a file, template text or shipped name (chat_template_text)
    metrics_token: str | None = None      # bearer token for /metrics besides the admin token
    metrics_public: bool = False          # /metrics without credentials (--metrics-public)
    redis_prefix: str = "lp:"
    adapter_grace_seconds: float = 600.0
    rate_window_seconds: float = 60.0     # the requests/tokens-per-minute window
    demo_tenant: bool = True              # create the `demo` tenant and a key on start
    replica_name: str | None = None       # --replica-name; None: hostname:port (see `replica`)
    lease_ttl: float = 10.0               # --lease-ttl: a silent replica's concurrency slots come back after this
    usage_settle_interval: float = 2.0    # --usage-settle-interval: running requests' usage recorded this often
    auth_failure_limit: int = 30          # --auth-failure-limit: failed key checks per window, per address and key id
    auth_failure_window_seconds: float = 60.0
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: operator adapters shared with tenants
    adapter_sources: tuple[str, ...] = ()  # --adapter-sources: kinds tenants may register by reference
    adapter_local_root: str | None = None  # --adapter-local-root
    adapter_s3_endpoint: str | None = None  # --adapter-s3-endpoint (None: AWS)
    adapter_s3_buckets: tuple[str, ...] = ()  # --adapter-s3-buckets (empty: any)
    adapter_http_hosts: tuple[str, ...] = ()  # --adapter-http-hosts (empty: any public host)
    adapter_allow_private_networks: bool = False  # --adapter-allow-private-networks
    adapter_fetch_timeout: float = 30.0   # --adapter-fetch-timeout, seconds for one whole fetch
    adapter_load_workers: int = 2         # --adapter-load-workers: loader processes (0: fetch in this process)
    adapter_loads_per_tenant: int = 1     # --adapter-loads-per-tenant: one tenant's fetches under way at once
    source_credentials_key_file: Path | None = None  # --source-credentials-key-file (None: in data_dir)
    lenient_request_fields: bool = False  # --lenient-request-fields: drop unknown fields (and say so) instead of 400
    strict_adapter_base: bool = False     # --strict-adapter-base: refuse an upload declaring another base model

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.replica_name is not None and not (isinstance(self.replica_name, str)
                                                  and _REPLICA_NAME_RE.fullmatch(self.replica_name)):
            raise ConfigError(f"--replica-name {self.replica_name!r}: use 1-128 characters from "
                              "A-Z a-z 0-9 . _ : @ -, starting with a letter or digit")
        if not isinstance(self.admin_token, str) or len(self.admin_token) < 16:
            raise ConfigError("the admin token must be at least 16 characters")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535, got {self.port}")
        if not isinstance(self.engine, EngineConfig):
            raise ConfigError(f"engine must be an EngineConfig, got {self.engine!r}")
        for name in ("max_upload_bytes", "max_request_bytes", "max_batch_prompts", "max_logprob_entries",
                     "max_grammar_compile_ms", "max_schema_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        pin_limit = self.engine.lora.max_pinned_adapters_per_tenant
        owners = Counter(tenant for tenant, _ in set(self.pin_adapters))
        if owners and max(owners.values()) > pin_limit:
            raise ConfigError(f"--pin-adapter names more adapters of one tenant than "
                              f"--max-pinned-adapters-per-tenant ({pin_limit})")
        if not self.compile_seconds_per_minute >= 0:
            raise ConfigError(f"--compile-seconds-per-minute must be >= 0, got {self.compile_seconds_per_minute}")
        if self.engine_process not in ENGINE_PROCESSES:
            raise ConfigError(f"--engine-process must be one of {', '.join(ENGINE_PROCESSES)}, "
                              f"got {self.engine_process!r}")
        if not isinstance(self.engine_restart_limit, int) or self.engine_restart_limit < 1:
            raise ConfigError(f"--engine-restart-limit must be >= 1, got {self.engine_restart_limit!r}")
        if not isinstance(self.api_server_count, int) or self.api_server_count < 1:
            raise ConfigError(f"--api-server-count must be >= 1, got {self.api_server_count!r}")
        if self.api_server_count > 1 and self.engine_process != "separate":
            raise ConfigError(f"--api-server-count {self.api_server_count} needs --engine-process separate "
                              f"(front ends share one engine core; got --engine-process {self.engine_process})")
        self._check_data_parallel()
        if not 0 <= self.shutdown_timeout <= 3600:
            raise ConfigError(f"--shutdown-timeout must be in 0..3600 seconds, got {self.shutdown_timeout}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        self.chat_template_text()
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ConfigError("--metrics-token must be at least 16 characters")
        if not 1.0 <= self.lease_ttl <= 3600.0:
            raise ConfigError(f"--lease-ttl must be in 1..3600 seconds, got {self.lease_ttl}")
        if not 0.1 <= self.usage_settle_interval <= 3600.0:
            raise ConfigError(f"--usage-settle-interval must be in 0.1..3600 seconds, got {self.usage_settle_interval}")
        if self.auth_failure_limit < 1 or not self.auth_failure_window_seconds > 0:
            raise ConfigError("--auth-failure-limit must be >= 1 (and its window > 0 s)")
        if not self.rate_window_seconds > 0:
            raise ConfigError("rate_window_seconds must be > 0")
        if len({n for n, _ in self.lora_modules}) != len(self.lora_modules):
            raise ConfigError("--lora-modules names must be unique")
        if not 0 <= self.adapter_load_workers <= 64:
            raise ConfigError(f"--adapter-load-workers must be in 0..64, got {self.adapter_load_workers}")
        if self.adapter_loads_per_tenant < 1:
            raise ConfigError(f"--adapter-loads-per-tenant must be >= 1, got {self.adapter_loads_per_tenant}")
        try:
            self.source_policy()
        except ValueError as e:
            raise ConfigError(f"adapter sources: {e}") from None
        owned = [(t, n) for t, n, _ in self.adapters]
        if len(set(owned)) != len(owned):
            raise ConfigError("--adapter names must be unique per tenant")
        if self.model not in (None, DEMO_MODEL_FLAG) and not (Path(self.model) / "config.json").is_file():
            from server.gguf_reader import is_gguf

            if not is_gguf(self.model):
                raise ConfigError(f"--model {self.model}: neither a Hugging Face model dir (no config.json there) "
                                  f"nor a GGUF file (use `{DEMO_MODEL_FLAG}` for the built-in random-weight model)")

    def _check_data_parallel(self) -> None:
        """--data-parallel-size: the combinations built (several engine-core processes behind one front
        end, or behind each of --api-server-count front ends); every other is refused in one line rather
        than accepted and ignored."""
        dp = self.data_parallel_size
        if not isinstance(dp, int) or dp < 1:
            raise ConfigError(f"--data-parallel-size must be >= 1, got {dp!r}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ConfigError(f"--data-parallel-routing must be one of {', '.join(DATA_PARALLEL_ROUTINGS)}, "
                              f"got {self.data_parallel_routing!r}")
        if dp == 1:
            return
        if self.engine_process != "separate":
            raise ConfigError(f"--data-parallel-size {dp} needs --engine-process separate (each engine core is a "
                              f"process of its own; got --engine-process {self.engine_process})")
        if self.engine.parallel.tensor_parallel_size > 1:
            raise ConfigError(f"--data-parallel-size {dp} does not combine with --tensor-parallel-size "
                              f"{self.engine.parallel.tensor_parallel_size} yet")
        if self.cpu_placement is not None and len(self.cpu_placement.engine) < dp:
            raise ConfigError(f"--data-parallel-size {dp} needs at least {dp} engine cores, one per engine-core "
                              f"process; the engine side has {len(self.cpu_placement.engine)} (--engine-cpus)")

    def source_policy(self):
        """What tenants may register adapters from (adapters.sources.SourcePolicy)."""
        from adapters.sources import SourcePolicy  # boto3 and httpx: only when serving

        return SourcePolicy(kinds=frozenset(self.adapter_sources),
                            local_root=Path(self.adapter_local_root) if self.adapter_local_root else None,
                            s3_endpoint=self.adapter_s3_endpoint, s3_buckets=frozenset(self.adapter_s3_buckets),
                            http_hosts=frozenset(self.adapter_http_hosts),
                            allow_private_networks=self.adapter_allow_private_networks,
                            max_file_bytes=self.max_upload_bytes, timeout_seconds=self.adapter_fetch_timeout)

    @property
    def uses_loader_processes(self) -> bool:
        """Whether adapters from sources are fetched in loader processes (and stored versions parsed in a
        pager process of their own, in the engine's process)."""
        return bool(self.adapter_load_workers and (self.adapter_sources or self.lora_modules))

    @property
    def runs_singletons(self) -> bool:
        """Whether this process does the once-per-server work: start-up writes (tenants, demo key,
        preloads, pins), the store's upkeep and the adapter-retirement listener. Front end 0 of several."""
        return self.front_end_index == 0

    @property
    def replica(self) -> str:
        """This process's name among replicas: --replica-name, else hostname:port. Derived here, not
        stored, so dataclasses.replace(config, port=...) keeps the default in step with the port."""
        if self.replica_name is not None:
            return self.replica_name
        host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-") or "localhost"
        return f"{host[:100]}:{self.port}"

    def engine_for(self, model_dir: str | Path) -> EngineConfig:
        """The engine's config on the checkpoint --model resolved to (the rest resolves as the engine starts:
        the prefill cap's auto by device type, --max-cpu-loras in bytes of the loaded model)."""
        return replace(self.engine, model=str(model_dir))

    @classmethod
    def of(cls, **flat: Any) -> ServerConfig:
        """From flat names, as tests and code build one: ServerConfig's own fields, and the engine's settings
        (max_loras=2, device="cpu", ...) over the CLI's defaults."""
        own, engine = _split_settings(flat)
        return cls(**own, engine=engine_config_of(engine))

    def with_settings(self, **flat: Any) -> ServerConfig:
        """This config with some of its own fields or the engine's settings (flat names) changed."""
        own, engine = _split_settings(flat)
        return replace(self, **own, engine=engine_config_of(engine, self.engine))

    def chat_template_text(self) -> str | None:
        """The chat template the server renders with (None: the tokenizer's own); server.chat_templates."""
        try:
            return resolve_chat_template(self.chat_template, default_model=self.model is None)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def model_id(self) -> str:
        return _model_id(self.served_model_name, self.model)

    @classmethod
    def from_args(cls, args, env: Mapping[str, str] | None = None) -> "ServerConfig":
        """From the `serve` subcommand's argparse namespace plus the environment."""
        env = os.environ if env is None else env
        data_dir = data_dir_of(args, env)
        token = args.admin_token or env.get("LORAPLEX_ADMIN_TOKEN") or None
        generated = token is None
        if generated:
            # Made once and kept in the data dir, so a restart keeps the same token.
            token = load_or_create_secret(data_dir / ADMIN_TOKEN_FILE,
                                          lambda: "lpadm-" + secrets.token_urlsafe(32))
        _refuse_restart_flags_in_process(args)
        _refuse_routing_without_data_parallel(args)
        placement = _cpu_placement(args)
        return cls(
            data_dir=data_dir, admin_token=token, admin_token_generated=generated,
            model=args.model, served_model_name=args.served_model_name,
            redis_url=redis_url_of(args, env),
            engine=_engine_of_args(args, placement),
            host=args.host, port=args.port,
            adapters=tuple(parse_adapter_flag(a) for a in args.adapter or ()),
            pin_adapters=tuple(parse_pin_flag(a) for a in getattr(args, "pin_adapter", None) or ()),
            engine_process=getattr(args, "engine_process", "separate"),
            engine_restart=_given(args, "engine_restart", True),
            engine_restart_limit=_given(args, "engine_restart_limit", 3),
            api_server_count=getattr(args, "api_server_count", 1),
            data_parallel_size=getattr(args, "data_parallel_size", 1),
            data_parallel_routing=_given(args, "data_parallel_routing", "affinity"),
            cpu_placement=placement,
            max_request_bytes=args.max_request_bytes, max_batch_prompts=args.max_batch_prompts,
            max_logprob_entries=getattr(args, "max_logprob_entries", 1 << 16),
            shutdown_timeout=getattr(args, "shutdown_timeout", 30.0),
            max_grammar_compile_ms=args.max_grammar_compile_ms, max_schema_bytes=args.max_schema_bytes,
            compile_seconds_per_minute=getattr(args, "compile_seconds_per_minute", 30.0),
            tool_call_parser=getattr(args, "tool_call_parser", "hermes"),
            enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", True),
            chat_template=getattr(args, "chat_template", None),
            metrics_token=args.metrics_token or env.get("LORAPLEX_METRICS_TOKEN") or None,
            metrics_public=args.metrics_public,
            replica_name=getattr(args, "replica_name", None) or None,
            lease_ttl=args.lease_ttl, usage_settle_interval=args.usage_settle_interval,
            auth_failure_limit=args.auth_failure_limit,
            lora_modules=tuple(_lora_modules(args, _model_id(args.served_model_name, args.model))),
            adapter_sources=tuple(_csv(getattr(args, "adapter_sources", None))),
            adapter_local_root=getattr(args, "adapter_local_root", None),
            adapter_s3_endpoint=getattr(args, "adapter_s3_endpoint", None),
            adapter_s3_buckets=tuple(_csv(getattr(args, "adapter_s3_buckets", None))),
            adapter_http_hosts=tuple(_csv(getattr(args, "adapter_http_hosts", None))),
            adapter_allow_private_networks=getattr(args, "adapter_allow_private_networks", False),
            adapter_fetch_timeout=getattr(args, "adapter_fetch_timeout", None) or 30.0,
            adapter_load_workers=getattr(args, "adapter_load_workers", 2),
            adapter_loads_per_tenant=getattr(args, "adapter_loads_per_tenant", 1),
            source_credentials_key_file=(Path(args.source_credentials_key_file).expanduser()
                                         if getattr(args, "source_credentials_key_file", None) else None),
            lenient_request_fields=getattr(args, "lenient_request_fields", False),
            strict_adapter_base=getattr(args, "strict_adapter_base", False))


def _engine_of_args(args, placement: CpuPlacement | None) -> EngineConfig:
    """The engine's settings from `serve`'s flags: each flag named as its setting, over the CLI's defaults,
    with the units and words converted here, once: --max-grammar-mask-ms in seconds, --engine-cpus as the
    engine's affinity."""
    # Settings without a flag of their name are not in `args`; --model is the server's (resolved at start).
    names = set(setting_names()) - {"model"}
    flat = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    for name in ("max_loras", "max_prefill_tokens_while_decoding"):  # None given: auto slots; the cap off
        if hasattr(args, name) and getattr(args, name) is None:
            flat[name] = None
    flat["max_mask_fill_seconds"] = getattr(args, "max_grammar_mask_ms", 1000) / 1000
    flat["max_mask_seconds_per_request"] = getattr(args, "max_grammar_mask_seconds", 60.0)
    if placement is not None:
        flat["cpu_affinity"] = placement.engine
    return engine_config_of(flat)


def engine_config_of(flat: Mapping[str, Any], base: EngineConfig | None = None) -> EngineConfig:
    """`base` (None: the CLI's defaults) with these settings, its refusals worded as the flags that give each
    setting (ConfigError). --max-cpu-loras takes the place of the byte budget (both given: refused)."""
    if flat.get("max_cpu_loras") is not None and "max_cpu_lora_bytes" not in flat:
        flat = {**flat, "max_cpu_lora_bytes": None}
    try:
        return (base or EngineConfig.of(**SERVE_ENGINE_DEFAULTS)).with_settings(**flat)
    except (TypeError, ValueError) as e:
        raise ConfigError(flag_worded(str(e))) from None


def _split_settings(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """ServerConfig's own fields, and the rest (engine settings, by flat name)."""
    own = {f.name for f in fields(ServerConfig)}
    return ({k: v for k, v in flat.items() if k in own}, {k: v for k, v in flat.items() if k not in own})


def flag_worded(message: str) -> str:
    """An engine config's refusal with each setting named as the `serve` flag that gives it."""
    names = sorted(set(setting_names()) - {"model"}, key=len, reverse=True)  # "model" is a word there too
    pattern = re.compile(r"(?<![-\w])(" + "|".join(names) + r")\b")
    return pattern.sub(lambda m: _FLAG_OF_SETTING.get(m.group(1), "--" + m.group(1).replace("_", "-")), message)


def _given(args, name: str, default):
    """A flag whose argparse default is None (so that giving it can be told apart): its value or default."""
    value = getattr(args, name, None)
    return default if value is None else value


def _refuse_restart_flags_in_process(args) -> None:
    """--engine-restart and its limit act on an engine-core process: given without one, they would be
    accepted and ignored."""
    if getattr(args, "engine_process", "separate") == "separate":
        return
    for flag, name in (("--engine-restart/--no-engine-restart", "engine_restart"),
                       ("--engine-restart-limit", "engine_restart_limit")):
        if getattr(args, name, None) is not None:
            raise ConfigError(f"{flag} applies to --engine-process separate only (the engine runs in the "
                              f"server's process here)")


def _refuse_routing_without_data_parallel(args) -> None:
    """--data-parallel-routing picks among engine cores: given with one, it would be accepted and ignored."""
    if getattr(args, "data_parallel_routing", None) is not None and getattr(args, "data_parallel_size", 1) == 1:
        raise ConfigError("--data-parallel-routing applies with --data-parallel-size > 1 only (one engine core: "
                          "nothing to route between)")


def _cpu_placement(args) -> "CpuPlacement | None":
    """--engine-cpus and --api-cpus (or the automatic split) on the cores this process may use."""
    from server.cpu_placement import CpuPlacementError, plan_placement
    from server.cpu_list import allowed_cpus

    try:
        return plan_placement(getattr(args, "engine_cpus", None), getattr(args, "api_cpus", None), allowed_cpus(),
                              automatic=getattr(args, "engine_process", "separate") == "separate",
                              engine_groups=getattr(args, "data_parallel_size", 1))
    except CpuPlacementError as e:
        raise ConfigError(str(e)) from None


def _model_id(served_model_name: str | None, model: str | None) -> str:
    """The id clients send: --served-model-name, else the default or demo model's, else --model's name."""
    if served_model_name:
        return served_model_name
    if model is None:
        return DEFAULT_MODEL_NAME
    if model == DEMO_MODEL_FLAG:
        return DEMO_MODEL_NAME
    return Path(model).resolve().name.removesuffix(".gguf")


def _csv(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _lora_modules(args, model_id: str) -> list[tuple[str, str]]:
    modules = []
    for value in getattr(args, "lora_modules", None) or ():
        name, path = parse_lora_module(value)
        base = _lora_module_base(value)
        if base is not None and base != model_id:
            raise ConfigError(f"--lora-modules {name}: base_model_name {base!r} is not the served model "
                              f"{model_id!r}")
        modules.append((name, path))
    return modules
