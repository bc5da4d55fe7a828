"""ServerConfig: everything `loraplex serve` was told, resolved and validated once."""
from __future__ import annotations

import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from server.credentials import ADMIN_TOKEN_FILE, load_or_create_secret

_ADAPTER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A replica name goes into a response header and a Prometheus label: plain ASCII, no spaces.
_REPLICA_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
DEMO_MODEL_NAME = "loraplex-demo"


class ConfigError(ValueError):
    """A flag or environment value that cannot work; the message names it."""


def default_data_dir(env: Mapping[str, str]) -> Path:
    """$LORAPLEX_DATA_DIR, else $XDG_DATA_HOME/loraplex, else ~/.local/share/loraplex."""
    if env.get("LORAPLEX_DATA_DIR"):
        return Path(env["LORAPLEX_DATA_DIR"]).expanduser()
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base).expanduser() / "loraplex"


def parse_adapter_flag(value: str) -> tuple[str, str]:
    """`NAME=DIR` -> (name, dir)."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ConfigError(f"--adapter expects NAME=DIR, got {value!r}")
    if not _ADAPTER_NAME_RE.fullmatch(name):
        raise ConfigError(f"--adapter name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ -")
    return name, path


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path
    admin_token: str
    admin_token_generated: bool = False   # kept in data_dir/admin-token and printed at start when True
    model: str | None = None              # None: the demo model under data_dir
    served_model_name: str | None = None
    redis_url: str | None = None          # None: an embedded redis-server under data_dir
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "auto"
    dtype: str = "auto"
    adapters: tuple[tuple[str, str], ...] = ()
    max_loras: int = 8
    max_lora_rank: int = 64
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_cpu_lora_bytes: int = 1 << 30     # host-tier budget: parsed adapters kept in host memory, by bytes
    kernels: str = "auto"
    cpu_threads: int | str = "auto"       # --cpu-threads: torch threads on a CPU device (server.engine.cpu_threads)
    quantization: str | None = None       # --quantization: the base projections' weights (None: float)
    max_upload_bytes: int = 512 << 20     # hard cap on an adapter upload body
    max_request_bytes: int = 16 << 20     # hard cap on a JSON request body (--max-request-bytes)
    max_batch_prompts: int = 64           # prompts in one /v1/completions batch (--max-batch-prompts)
    enable_prefix_caching: bool = True    # --enable-prefix-caching / --no-enable-prefix-caching
    share_base_prefix_cache: bool = False  # --share-base-prefix-cache (a cross-tenant timing channel)
    metrics_token: str | None = None      # bearer token for /metrics besides the admin token
    metrics_public: bool = False          # /metrics without credentials (--metrics-public)
    redis_prefix: str = "lp:"
    adapter_grace_seconds: float = 600.0
    rate_window_seconds: float = 60.0     # the requests/tokens-per-minute window
    demo_tenant: bool = True              # create the `demo` tenant and a key on start
    seed: int = 0
    replica_name: str | None = None       # --replica-name; None: hostname:port (see `replica`)

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
        for name in ("max_loras", "max_lora_rank", "max_num_seqs", "max_num_batched_tokens",
                     "max_upload_bytes", "max_request_bytes", "max_batch_prompts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.metrics_token is not None and len(self.metrics_token) < 16:
            raise ConfigError("--metrics-token must be at least 16 characters")
        if not self.rate_window_seconds > 0:
            raise ConfigError("rate_window_seconds must be > 0")
        if self.max_cpu_lora_bytes < 0:
            raise ConfigError("--max-cpu-lora-bytes must be >= 0")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 1:
            raise ConfigError("--kv-cache-blocks must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len must be >= 2")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization must be in (0, 1]")
        # Imported here: server.engine's package import pulls in torch, which `loraplex --help` avoids.
        from server.engine.config import check_quantization_name
        from server.engine.cpu_threads import CpuThreadsError, parse_cpu_threads

        try:
            check_quantization_name(self.quantization)
        except ValueError as e:
            raise ConfigError(f"--quantization: {e}") from None

        try:
            object.__setattr__(self, "cpu_threads", parse_cpu_threads(self.cpu_threads))
        except CpuThreadsError as e:
            raise ConfigError(f"--cpu-threads: {e}") from None
        names = [n for n, _ in self.adapters]
        if len(set(names)) != len(names):
            raise ConfigError("--adapter names must be unique")
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(f"--model {self.model}: no config.json there (need a Hugging Face model dir)")

    @property
    def replica(self) -> str:
        """This process's name among replicas: --replica-name, else hostname:port. Derived here, not
        stored, so dataclasses.replace(config, port=...) keeps the default in step with the port."""
        if self.replica_name is not None:
            return self.replica_name
        host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip(".-") or "localhost"
        return f"{host[:100]}:{self.port}"

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return DEMO_MODEL_NAME if self.model is None else Path(self.model).resolve().name

    @classmethod
    def from_args(cls, args, env: Mapping[str, str] | None = None) -> "ServerConfig":
        """From the `serve` subcommand's argparse namespace plus the environment."""
        env = os.environ if env is None else env
        data_dir = Path(args.data_dir).expanduser() if args.data_dir else default_data_dir(env)
        token = args.admin_token or env.get("LORAPLEX_ADMIN_TOKEN") or None
        generated = token is None
        if generated:
            # Made once and kept in the data dir, so a restart keeps the same token.
            token = load_or_create_secret(data_dir / ADMIN_TOKEN_FILE,
                                          lambda: "lpadm-" + secrets.token_urlsafe(32))
        return cls(
            data_dir=data_dir, admin_token=token, admin_token_generated=generated,
            model=args.model, served_model_name=args.served_model_name,
            redis_url=args.redis_url or env.get("LORAPLEX_REDIS_URL") or None,
            host=args.host, port=args.port, device=args.device, dtype=args.dtype,
            adapters=tuple(parse_adapter_flag(a) for a in args.adapter or ()),
            max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_blocks=args.kv_cache_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.9,
            max_cpu_lora_bytes=args.max_cpu_lora_bytes if args.max_cpu_lora_bytes is not None else 1 << 30,
            kernels=args.kernels, cpu_threads=getattr(args, "cpu_threads", "auto"),
            quantization=getattr(args, "quantization", None),
            max_request_bytes=args.max_request_bytes, max_batch_prompts=args.max_batch_prompts,
            enable_prefix_caching=args.enable_prefix_caching,
            share_base_prefix_cache=args.share_base_prefix_cache,
            metrics_token=args.metrics_token or env.get("LORAPLEX_METRICS_TOKEN") or None,
            metrics_public=args.metrics_public,
            replica_name=getattr(args, "replica_name", None) or None)
