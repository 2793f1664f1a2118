"""The engine's view of one request: token ids, progress counters and status.

Progress is a counter, not a phase: `num_computed_tokens` says how many of the request's
tokens have their K/V in the cache. Whatever is left (`num_tokens - num_computed_tokens`) is
what the scheduler may run next: the whole prompt, a chunk of it, one decode token, or all of
it again after a preemption.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from nanollmserve.engine.messages import EngineCoreRequest, TokenLogprobs
from nanollmserve.engine.structured_output import GrammarState

if TYPE_CHECKING:
    from nanollmserve.engine.lora_adapter import LoRAAdapter


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    """Preparing or sampling this request raised: it ends alone, the step goes on."""

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        core_request: EngineCoreRequest,
        eos_token_ids: frozenset[int] | set[int],
        max_tokens: int,
    ):
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.sampling_params = core_request.sampling_params
        self.arrival_time = core_request.arrival_time or time.time()
        params = self.sampling_params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        # Masked by the sampler while fewer than min_tokens are out (built once, not per step).
        self.min_tokens_blocked_ids = tuple(sorted(self.eos_token_ids | self.stop_token_ids))
        self.max_tokens = max_tokens
        # Structured output: advanced by every appended token; its end finishes the request.
        self.grammar = None
        if core_request.grammar:
            structured = params.structured_outputs
            thinking = structured.after_thinking if structured is not None else None
            self.grammar = GrammarState(core_request.grammar, thinking)
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, grown lazily
        self.block_digests: list[bytes] = []  # the same chain, stable across processes (KV offload)
        # Draft tokens for the next step (speculative decoding), moved by the scheduler into
        # its SchedulerOutput.
        self.spec_token_ids: list[int] = []
        self.first_scheduled_time: float | None = None
        self.last_token_time: float | None = None  # when its latest token was sampled
        # Set by the model runner on first use, on its device (seeded requests only).
        self.generator: torch.Generator | None = None
        # The LoRA adapter it runs with (None: the base model), set by EngineCore.
        self.lora: LoRAAdapter | None = None
        # With `prompt_logprobs`: entry i is prompt token i + 1's, filled by the model runner
        # as the prompt's chunks run (a resume after preemption adds none).
        self.prompt_logprobs: list[TokenLogprobs] = []

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and the runner has not computed them all yet."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def lora_id(self) -> int:
        """0 for the base model, else the adapter's unique id (it salts the prefix hashes)."""
        return self.lora.uid if self.lora is not None else 0

    @property
    def prefix_cache_root(self) -> int | tuple[int, str]:
        """What the first block's prefix hash is chained to: the LoRA adapter id, paired with
        the request's `cache_salt` when it has one, so only requests with the same adapter and
        the same salt share blocks."""
        salt = self.sampling_params.cache_salt
        return self.lora_id if salt is None else (self.lora_id, salt)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_token(self, token_id: int) -> bool:
        """Append a sampled token -> False, appending nothing, when the request's grammar
        refuses it: the sampler can only draw such a token when every token was masked (the
        grammar allows only its stop tokens and `min_tokens` blocks them), and it would end
        a finished answer with a stray token."""
        if self.grammar is not None and not self.grammar.accept_token(token_id):
            return False
        self.all_token_ids.append(token_id)
        return True

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
