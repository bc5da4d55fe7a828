"""A TCP proxy that delays every reply chunk by a fixed time: a Redis that answers correctly but
some milliseconds away (another zone, a busy network), so round trips cost what they would there.

Run as its own process (`python -m tests.latency_proxy LISTEN_PORT TARGET_PORT DELAY_MS`): in the
process of the server under test, its timing would share that server's GIL. It prints "ready" once
it listens. Replies keep their order; chunks in flight are delayed together, not one after another,
so a pipeline of many commands costs one delay, as it would over a real link.
"""
from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    loop = asyncio.get_running_loop()
    pending: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await pending.get()
            if not chunk:
                break
            await asyncio.sleep(max(0.0, due - loop.time()))
            writer.write(chunk)
            await writer.drain()

    delivering = asyncio.create_task(deliver())
    try:
        while chunk := await reader.read(65536):
            pending.put_nowait((loop.time() + delay, chunk))
    finally:
        pending.put_nowait((0.0, b""))
        try:
            await delivering
        except ConnectionError:
            pass
        writer.close()


async def _serve(listen_port: int, target_port: int, delay: float) -> None:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, server_writer, 0.0), _pipe(server_reader, client_writer, delay),
                             return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    listen, target, delay_ms = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    asyncio.run(_serve(listen, target, delay_ms / 1000.0))
