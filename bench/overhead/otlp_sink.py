"""A stand-in OTLP collector for the tracing A/B of bench/overhead: takes every
POST /v1/traces (200, body read and dropped) and answers GET /ready, so a traced
gateway's exports cost it what a real collector's would, and nothing else.

    python -m bench.overhead.otlp_sink --port PORT
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web

POSTS = web.AppKey("posts", list)


async def _take(request: web.Request) -> web.Response:
    request.app[POSTS].append(len(await request.read()))
    return web.Response(content_type="application/x-protobuf")


async def _ready(request: web.Request) -> web.Response:
    return web.json_response({"posts": len(request.app[POSTS])})


async def serve(host: str, port: int) -> None:
    app = web.Application()
    app[POSTS] = []
    app.router.add_post("/v1/traces", _take)
    app.router.add_get("/ready", _ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()  # SIGTERM from the bench: a clean exit, status 0
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
