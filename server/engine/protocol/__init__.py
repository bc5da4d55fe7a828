"""The typed engine protocol: what the front end sends the engine and what comes back.

EngineClient is the whole interface; InProcessEngineClient (server.engine.async_engine) runs
it over the step loop in this process. Import that one from its module: this package's names are the
messages, which carry no engine internals.
"""
from server.engine.protocol.client import EngineClient
from server.engine.protocol.cores import EngineCoreReport
from server.engine.protocol.errors import EngineDeadError, RequestError
from server.engine.protocol.info import EngineInfo
from server.engine.protocol.outputs import OutputStream, RequestOutput, TokenLogprobs
from server.engine.protocol.request import EngineRequest
from server.engine.protocol.residency import AdapterTiers, LoadTimes
from server.engine.protocol.snapshot import EngineSnapshot, EngineStats
from server.engine.block_manager import KvBlockStats  # EngineStats.kv_blocks's type
from server.engine.scheduler import SpecDecodeStats  # EngineStats.speculative's type
from server.engine.unified_memory import UnifiedPool  # KvPoolInfo.unified's type (--unified-memory)

__all__ = ["AdapterTiers", "EngineClient", "EngineCoreReport", "EngineDeadError", "EngineInfo", "EngineRequest",
           "EngineSnapshot", "EngineStats", "KvBlockStats", "LoadTimes", "OutputStream", "RequestError", "RequestOutput",
           "SpecDecodeStats", "TokenLogprobs", "UnifiedPool"]
