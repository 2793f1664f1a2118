"""`serve_router(app, sock, ...)`: runs the router app with uvicorn on a socket bound
beforehand (a busy port fails before anything starts), logs one ready line, and returns once
`stop` is set; without a `stop` event, SIGINT / SIGTERM set one (the `router` command; the
`cluster` command owns the signals and passes its own). Either way it exits cleanly, status 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

logger = logging.getLogger("nanollmserve.router")


async def serve_router(
    app,
    sock: socket.socket,
    log_level: str = "info",
    stop: asyncio.Event | None = None,
) -> None:
    import uvicorn

    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    pool = app.state.pool
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                logger.info(
                    "nanollmserve router ready: %s policy=%s workers=%d (%d healthy)",
                    url,
                    app.state.settings.policy,
                    len(pool.all()),
                    len(pool.healthy()),
                )

        @contextlib.contextmanager
        def capture_signals(self):  # the stop event stands for them
            yield

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug")
    server = Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
