"""The engine core in its own process (`serve --engine-process separate`).

The front end (HTTP, tokenizing, grammar compiles, SSE) talks to it through RemoteEngineClient
(server.engine.protocol.remote) over ZMQ, msgpack-encoded msgspec messages (server.engine.core.messages),
never pickle. In the core, one busy loop (server.engine.core.busy_loop) owns the LLMEngine and only
reads and writes in-memory queues; an input socket thread decodes what the front ends send and an
output socket thread encodes what goes back, so (de)serialisation never runs on the step loop.
Started as `python -m server.engine.core` with its CoreLaunch on stdin (server.engine.core.launcher).
"""
