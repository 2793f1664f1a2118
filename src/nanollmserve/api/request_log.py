"""The request log: one INFO line per ended request (`nanollmserve serve` logs them unless
`--disable-log-requests`), from an engine observer, so every endpoint (HTTP and gRPC) is
covered and the numbers are the engine's own:

    request chatcmpl-1a2b-0: status=finished finish_reason=stop prompt_tokens=25
    cached_tokens=16 generated_tokens=12 ttft=0.041s e2e=0.312s

(one line). The prompt text is never logged unless `log_prompts` (`--log-prompts`).
"""

from __future__ import annotations

import logging

from nanollmserve.outputs import RequestOutput

logger = logging.getLogger("nanollmserve.requests")


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
