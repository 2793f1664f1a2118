"""`serve_router(app, sock, ...)`: runs the router app with uvicorn on a socket bound
beforehand (a busy port fails before anything starts), logs one ready line, and returns once
`stop` is set; without a `stop` event, SIGINT / SIGTERM set one (the `router` command; the
`cluster` command owns the signals and passes its own). With `shutdown_timeout` it drains
first: it keeps listening, answers new requests and `/ready` 503 `draining` (`app.py`) and
waits up to that long for the requests it forwarded to end. Either way it exits cleanly,
status 0.
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
    shutdown_timeout: float = 0.0,
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
    if stop.is_set() and shutdown_timeout > 0:
        await _drain(app, pool, shutdown_timeout, serving)
    server.should_exit = True
    stopping.cancel()
    await serving


async def _drain(app, pool, timeout: float, serving: asyncio.Task) -> None:
    """Still listening, answer 503 `draining` to new requests and /ready while the ones
    forwarded finish, for up to `timeout` seconds (then uvicorn's shutdown waits for the
    streams still open)."""
    app.state.draining = True
    deadline = asyncio.get_running_loop().time() + timeout
    logger.info("draining: %d request(s) in flight", _in_flight(pool))
    while _in_flight(pool) and not serving.done():
        if asyncio.get_running_loop().time() >= deadline:
            logger.warning(
                "drain: %d request(s) still in flight after %.1f s", _in_flight(pool), timeout
            )
            return
        await asyncio.sleep(0.05)


def _in_flight(pool) -> int:
    return sum(worker.num_in_flight for worker in pool.all())
