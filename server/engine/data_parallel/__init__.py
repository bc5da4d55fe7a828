"""--data-parallel-size N: N engine-core processes behind one front end (issue 39, item 2).

Each core is a RemoteEngineClient of its own (server.engine.protocol.remote): its own process on its
share of the engine's CPU cores (core_split), its own KV cache, adapter slots and host tier, and its own
restart under --engine-restart. DataParallelEngineClient (client) is the one EngineClient the front end
holds: it routes each request (router: adapter residency, then load; or round-robin), sends adapter
commands to every core, and aggregates the cores' counters (stats_merge).
"""
