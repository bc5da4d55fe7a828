"""The typed engine protocol: what the front end sends the engine and what comes back.

EngineClient is the whole interface; InProcessEngineClient (server.engine.protocol.in_process) runs
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
from server.engine.spec_decode_stats import SpecDecodeStats  # EngineStats.speculative's type

__all__ = ["AdapterTiers", "EngineClient", "EngineCoreReport", "EngineDeadError", "EngineInfo", "EngineRequest", "EngineSnapshot",
           "EngineStats", "LoadTimes", "OutputStream", "RequestError", "RequestOutput", "SpecDecodeStats",
           "TokenLogprobs"]
