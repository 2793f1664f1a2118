"""EngineDriver: the one in-process engine client, used by the offline `LLM` and by the
server's engine thread alike.

It pairs the EngineCore (token ids in and out) with the OutputProcessor (text, stop strings,
`n` choices): it admits a request's child requests all or none, steps the engine and turns
what the step produced into RequestOutputs, aborts the children a stop string finished, and
aborts whole requests. It is not thread-safe: one thread drives it (the caller's thread for
`LLM`, the engine thread for the server).

    driver = EngineDriver(EngineCore(config), tokenizer)
    driver.add_request(admission.admit("r1", "Hi", prompt_token_ids, params))
    while driver.has_unfinished_requests():
        for output in driver.step().outputs:
            ...
"""

from __future__ import annotations

from dataclasses import dataclass

from nanollmserve.engine.engine_core import EngineCore
from nanollmserve.errors import ParamError
from nanollmserve.frontend.admission import AdmittedRequest
from nanollmserve.frontend.output_processor import AbortedRequest, OutputProcessor
from nanollmserve.outputs import RequestOutput


@dataclass
class DriverStep:
    """What one engine step produced."""

    outputs: list[RequestOutput]
    """For the consumers: one per request with something new (by its OutputKind)."""
    finished: list[RequestOutput]
    """The full final output of every request that ended in this step (for observers)."""
    num_engine_outputs: int
    """Requests that got a token in this step."""


class EngineDriver:
    def __init__(self, engine: EngineCore, tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)

    def add_request(self, request: AdmittedRequest) -> None:
        """Run the `n` child requests of an admitted request; raises ValueError (and runs
        none of them) if its id is taken or the engine refuses one (it is asleep)."""
        request_id = request.request_id
        if self.output_processor.has_request(request_id):
            raise ParamError(f"request id {request_id!r} is already running", "request_id")
        self.output_processor.add_request(request)
        try:
            for child in request.children:
                self.engine.add_request(child)
        except ValueError:
            self.abort_request(request_id)
            raise

    def abort_request(self, request_id: str) -> AbortedRequest | None:
        """End a request as aborted; its KV blocks return to the pool now. None if it is
        unknown or already finished."""
        aborted = self.output_processor.abort_request(request_id)
        if aborted is not None:
            self.engine.abort_requests(aborted.running_child_ids)
        return aborted

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> DriverStep:
        engine_outputs = self.engine.step().outputs
        processed = self.output_processor.process_outputs(engine_outputs)
        self.engine.abort_requests(processed.child_ids_to_abort)  # stopped by a stop string
        return DriverStep(
            processed.request_outputs, processed.finished_outputs, len(engine_outputs)
        )
