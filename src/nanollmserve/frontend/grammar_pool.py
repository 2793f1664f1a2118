"""GrammarCompilePool: the server's grammars compiled on a few worker threads of their own,
each within a deadline, so a slow grammar delays only its own request.

The tokenizer thread, the event loop and the engine thread never compile: `compile()` checks
the size limits on the caller's thread (a bounded walk), answers from the compiler's cache,
joins a compile of the same grammar already under way, or queues a new one for the
`--structured-outputs-workers` daemon threads, and waits for it without blocking the loop
(XGrammar releases the GIL while it compiles).

A Python thread cannot be stopped, so the deadline (`--structured-outputs-timeout`) bounds
what the request waits for, not the work:
- a compile still queued when its deadline passes is cancelled (it never runs) and the
  request gets EngineOverloadedError (503 with Retry-After: every worker is busy);
- a compile that runs past its deadline fails its request with a 400 naming the flag and
  runs on to its end on its worker (which is why the workers are few and bounded); its
  grammar is remembered as too slow, so sending it again fails at once instead of taking a
  worker again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from nanollmserve.engine.grammar_compiler import GrammarCompiler
from nanollmserve.errors import ParamError
from nanollmserve.frontend.engine_loop import EngineOverloadedError
from nanollmserve.structured_output_limits import StructuredOutputLimits, flag
from nanollmserve.structured_outputs import StructuredOutputsParams

TOO_SLOW_REMEMBERED = 1024
"""Grammars remembered as too slow to compile (their digests; least recent dropped first)."""


class _CompileJob:
    def __init__(self, key: tuple, params: StructuredOutputsParams, param: str) -> None:
        self.key = key
        self.params = params
        self.param = param
        self.future: Future = Future()
        self.started_at: float | None = None


class GrammarCompilePool:
    def __init__(self, compiler: GrammarCompiler, limits: StructuredOutputLimits) -> None:
        self.compiler = compiler
        self.timeout = limits.structured_outputs_timeout
        self.num_workers = limits.structured_outputs_workers
        self._queue: queue.SimpleQueue[_CompileJob] = queue.SimpleQueue()
        self._jobs: dict[tuple, _CompileJob] = {}  # queued or running, by grammar key
        self._too_slow: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._num_running = 0
        self._workers: list[threading.Thread] = []  # started with the first grammar

    @property
    def num_running(self) -> int:
        """Compiles running now (on a worker, overrunning ones included)."""
        return self._num_running

    async def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs"):
        """The compiled grammar of `params`. Raises ParamError (a limit, a grammar that does
        not compile or not within the deadline) or EngineOverloadedError (no worker free in
        time)."""
        self.compiler.check(params, param)
        key = params.key
        digest = hashlib.sha256(repr(key).encode()).hexdigest()
        with self._lock:
            if digest in self._too_slow:
                self._too_slow.move_to_end(digest)
                raise self._timeout_error(param)
        compiled = self.compiler.cached(key)
        if compiled is not None:
            return compiled
        job = self._submit(key, params, param)
        waiting = asyncio.wrap_future(job.future)
        done, _ = await asyncio.wait({waiting}, timeout=self.timeout)
        while not done and job.started_at is None and not self.compiler.is_ready:
            # The one-time build of the tokenizer's grammar tables (seconds on a loaded
            # machine) is the server warming up, not this request's grammar: wait it out.
            done, _ = await asyncio.wait({waiting}, timeout=self.timeout)
        if not done and job.started_at is None and job.future.cancel():
            raise self._busy_error()
        if not done and job.started_at is not None:
            remaining = job.started_at + self.timeout - time.monotonic()
            done, _ = await asyncio.wait({waiting}, timeout=max(remaining, 0))
        if job.future.cancelled():  # another request sharing this compile gave up waiting
            raise self._busy_error()
        if not done:
            with self._lock:
                self._too_slow[digest] = None
                while len(self._too_slow) > TOO_SLOW_REMEMBERED:
                    self._too_slow.popitem(last=False)
            raise self._timeout_error(param)
        return job.future.result()

    def _submit(self, key: tuple, params: StructuredOutputsParams, param: str) -> _CompileJob:
        with self._lock:
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _CompileJob(key, params, param)
                self._queue.put(job)
            while len(self._workers) < self.num_workers:
                worker = threading.Thread(
                    target=self._work, name=f"grammar-{len(self._workers)}", daemon=True
                )
                worker.start()
                self._workers.append(worker)
        return job

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            # Once, and not counted against any request's deadline; an error here is raised
            # again by the compile below, to the requests waiting for it.
            with contextlib.suppress(Exception):
                self.compiler.warm_up()
            job.started_at = time.monotonic()  # before running: a waiter that sees None may cancel
            if not job.future.set_running_or_notify_cancel():
                self._forget(job)
                continue
            with self._lock:
                self._num_running += 1
            try:
                result: Any = self.compiler.compile(job.params, job.param)
            except BaseException as exc:  # delivered to the requests waiting for it
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            finally:
                with self._lock:
                    self._num_running -= 1
                self._forget(job)

    def _forget(self, job: _CompileJob) -> None:
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]

    def _timeout_error(self, param: str) -> ParamError:
        return ParamError(
            f"the structured output did not compile within {self.timeout:g} s "
            f"({flag('structured_outputs_timeout')} {self.timeout:g}); send a smaller or "
            "simpler schema or grammar",
            param=param,
        )

    def _busy_error(self) -> EngineOverloadedError:
        return EngineOverloadedError(
            f"every grammar compile worker stayed busy for {self.timeout:g} s "
            f"({flag('structured_outputs_workers')} {self.num_workers}); retry later"
        )
