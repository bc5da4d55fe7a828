"""Checks the config sections share: each names the setting it refuses."""
from __future__ import annotations


def check_bools(section: object, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(section, name), bool):
            raise ValueError(f"{name} must be true or false")


def check_at_least(section: object, minimum: int, *names: str) -> None:
    """Each of `names` that is set (not None) must be >= minimum."""
    for name in names:
        value = getattr(section, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
