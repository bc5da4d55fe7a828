"""Start-up mistakes that need no model, found before it loads and before torch is imported: each a
one-line ConfigError that names the flag and the fix (the full validation still runs later, against
the model's shapes).

- the data dir: one server at a time while it runs the embedded Redis (server.data_dir_lock);
- `--adapter` and local `--lora-modules` paths: there, a PEFT directory, of a rank within
  `--max-lora-rank` (a remote source is checked when it is fetched);
- the embedded Redis: the data dir's recorded redis-server can be used (server.embedded_redis.binary).
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Mapping

from server.config import ConfigError, data_dir_of, parse_adapter_flag, parse_lora_module, redis_url_of
from server.data_dir_lock import hold_data_dir
from server.embedded_redis import DATA_SUBDIR
from server.engine.config import MAX_LORA_RANK

_CONFIG_FILE = "adapter_config.json"
_MAX_CONFIG_BYTES = 1 << 20  # adapters.format.MAX_CONFIG_BYTES: that module imports torch


def check_before_model(args, env: Mapping[str, str], held: ExitStack) -> None:
    """`serve`'s namespace; the data dir's lock, when taken, stays in `held`."""
    data_dir = data_dir_of(args, env)
    embedded = redis_url_of(args, env) is None
    if embedded:
        held.enter_context(hold_data_dir(data_dir))
    for value in args.adapter or ():
        _, name, path = parse_adapter_flag(value)
        _check_adapter_dir(f"--adapter {name}", path, args.max_lora_rank)
    for value in args.lora_modules or ():
        name, source = parse_lora_module(value)
        local = _local_path(source)
        if local is not None:
            _check_adapter_dir(f"--lora-modules {name}", local, args.max_lora_rank)
    if embedded:
        _check_redis_binary(data_dir / DATA_SUBDIR)


def _local_path(source: str) -> str | None:
    """A --lora-modules source's local path (a directory or an archive), None for a remote one."""
    if source.startswith("file://"):
        return source.removeprefix("file://").removeprefix("localhost")
    return None if "://" in source else source


def _check_adapter_dir(flag: str, path: str, max_rank: int) -> None:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{flag}: {path} does not exist; give the path of a PEFT adapter directory "
                          f"(adapter_config.json and adapter_model.safetensors)")
    if p.is_file():
        return  # an archive: opened by the fetch
    config = p / _CONFIG_FILE
    if not config.is_file():
        raise ConfigError(f"{flag}: {path} has no {_CONFIG_FILE}; give the path of a PEFT adapter directory")
    try:
        raw = json.loads(config.read_bytes() if config.stat().st_size <= _MAX_CONFIG_BYTES else b"")
    except (OSError, ValueError):
        raw = None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: {config} is not a JSON object of at most {_MAX_CONFIG_BYTES} bytes; "
                          "fix the file or drop the flag")
    pattern = raw.get("rank_pattern")
    ranks = [raw.get("r", 8), *(pattern.values() if isinstance(pattern, dict) else ())]
    rank = max((r for r in ranks if isinstance(r, int) and not isinstance(r, bool)), default=0)
    if rank > max_rank:
        raise ConfigError(f"{flag}: {path} has rank {rank}, above --max-lora-rank {max_rank}; raise "
                          f"--max-lora-rank to at least {rank} (at most {MAX_LORA_RANK}) or drop the adapter")


def _check_redis_binary(redis_dir: Path) -> None:
    from server.embedded_redis.binary import BinaryMismatch, choose_binary
    from server.embedded_redis.server import EmbeddedRedisError, find_redis_server

    try:
        choose_binary(redis_dir, find_redis_server(), explicit=False)
    except (BinaryMismatch, EmbeddedRedisError) as e:
        raise ConfigError(str(e)) from None
