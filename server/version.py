"""Installed versions, for `loraplex --version`, /version, /health, /metrics and /openapi.json."""
from __future__ import annotations

import functools
from importlib import metadata


# Read once per process: the code running is what was imported at start (an upgrade on disk is not
# it), and each read parses the distribution's metadata files, ~2 ms of CPU holding the GIL on the
# event loop; /health answered it on every poll, and a poller every 50 ms took ~4% of a core.
@functools.cache
def package_version(name: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def loraplex_version() -> str:
    return package_version("loraplex") or "unknown (not installed)"
