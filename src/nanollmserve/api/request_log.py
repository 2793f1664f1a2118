"""The request log: one INFO line per ended request (`nanollmserve serve` logs them unless
`--disable-log-requests`), from an engine observer, so every endpoint (HTTP and gRPC) is
covered and the numbers are the engine's own:

    request chatcmpl-1a2b-0: status=finished finish_reason=stop prompt_tokens=25
    cached_tokens=16 generated_tokens=12 ttft=0.041s e2e=0.312s

(one line). The prompt text is never logged unless `log_prompts` (`--log-prompts`).

Engine request ids are always the server's. A client's own id (HTTP `X-Request-Id`, gRPC
`request_id`) is echoed back to it and logged once, at admission, next to the server's id,
quoted as a Python literal, so a newline or a control character in it cannot forge a line:

    request chatcmpl-1a2b: client_request_id='abc\\nrequest forged: ...'
"""

from __future__ import annotations

import logging

from nanollmserve.outputs import RequestOutput

logger = logging.getLogger("nanollmserve.requests")


REQUEST_ID_HEADER = "X-Request-Id"
"""The HTTP header a client names its request with (echoed in the response's)."""


def log_client_request_id(request_id: str, client_request_id: str) -> None:
    """Log which client id the server's `request_id` stands for (the client's quoted)."""
    logger.info("request %s: client_request_id=%r", request_id, client_request_id)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


class RequestLogger:
    """An engine observer (`AsyncEngine.add_observer`); runs on the engine thread."""

    def __init__(self, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts

    def on_step(self, stats) -> None:
        pass

    def on_request_finished(self, output: RequestOutput) -> None:
        logger.info(self.line(output))

    def line(self, output: RequestOutput) -> str:
        reasons = [c.finish_reason or "none" for c in output.outputs]
        status = "aborted" if "abort" in reasons or not reasons else "finished"
        metrics = output.metrics
        line = (
            f"request {output.request_id}: status={status} "
            f"finish_reason={','.join(reasons) or '-'} "
            f"prompt_tokens={len(output.prompt_token_ids)} "
            f"cached_tokens={output.num_cached_tokens} "
            f"generated_tokens={sum(len(c.token_ids) for c in output.outputs)} "
            f"ttft={_seconds(metrics.ttft if metrics else None)} "
            f"e2e={_seconds(metrics.e2e_latency if metrics else None)}"
        )
        if self.log_prompts:
            line += f" prompt={output.prompt!r}"
        return line
