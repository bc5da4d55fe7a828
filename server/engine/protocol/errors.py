"""The errors an engine client raises to the front end."""
from __future__ import annotations

from server.engine.llm_engine import RequestError

__all__ = ["EngineDeadError", "RequestError"]


class EngineDeadError(RuntimeError):
    """The step loop crashed or was shut down; no request can be served."""
