"""Installed versions, for `loraplex --version`, /version, /health, /metrics and /openapi.json."""
from __future__ import annotations

from importlib import metadata


def package_version(name: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def loraplex_version() -> str:
    return package_version("loraplex") or "unknown (not installed)"
