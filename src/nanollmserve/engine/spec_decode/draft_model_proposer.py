"""The draft-model proposer: a smaller model with the target's vocabulary guesses k tokens.

The draft model has its own model runner, its own paged KV cache (as many blocks as the
target's) and its own block bookkeeping (no prefix caching). For each request it keeps a
shadow `Request` holding the tokens whose K/V are in the draft cache. Each step it first
catches up (runs, in one forward for the whole batch, the tokens the target accepted since
the last step; the whole prompt the first time), which samples the first draft, then runs
k - 1 one-token forwards, decoding greedily. Drafts the target rejected are forgotten by
counting: the next step keeps the shadow's K/V only up to the first token that differs from
the request's, and recomputes from there.
"""

from __future__ import annotations

from nanollmserve.engine.kv_cache import KVCacheManager
from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.engine.model_runner import ModelRunner
from nanollmserve.engine.request import Request
from nanollmserve.engine.scheduler import SchedulerOutput
from nanollmserve.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    def __init__(
        self, runner: ModelRunner, num_blocks: int, block_size: int, max_model_len: int
    ) -> None:
        self.runner = runner
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reset()

    def reset(self) -> None:
        self.kv_cache = KVCacheManager(self.num_blocks, self.block_size, False)
        self.shadows: dict[str, Request] = {}
        # Request id -> how many leading shadow tokens are known to be the request's.
        self.num_verified: dict[str, int] = {}

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Up to `num_drafts[i]` greedy draft tokens for each request; also drops the draft
        cache of every request not in `requests` (finished, aborted or preempted)."""
        live = {r.request_id for r in requests}
        for request_id in [i for i in self.shadows if i not in live]:
            self._drop(request_id)
        batch: list[tuple[Request, int, int]] = []  # (shadow, num tokens of the request, k)
        for request, k in zip(requests, num_drafts, strict=True):
            if k < 1 or request.num_tokens + k > self.max_model_len:
                continue
            shadow = self._sync(request)
            num_catch_up = shadow.num_tokens - shadow.num_computed_tokens
            # Slots for the catch-up tokens and the k - 1 drafts fed back in.
            if self.kv_cache.allocate_slots(shadow, num_catch_up + k - 1):
                batch.append((shadow, request.num_tokens, k))
            else:  # the draft pool is full: this request decodes without drafts
                self._drop(request.request_id)
        for round_index in range(max((k for _, _, k in batch), default=0)):
            self._forward([s for s, _, k in batch if k > round_index])
        drafts = {s.request_id: s.all_token_ids[n : n + k] for s, n, k in batch}
        return [drafts.get(r.request_id, []) for r in requests]

    def _sync(self, request: Request) -> Request:
        """The request's shadow, its tokens set to the request's and its K/V kept up to the
        first token where the two differ (a rejected draft)."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            core = EngineCoreRequest(request.request_id, list(request.all_token_ids), _GREEDY)
            shadow = Request(core, frozenset(), max_tokens=0)
            self.shadows[request.request_id] = shadow
        else:
            tokens, old = request.all_token_ids, shadow.all_token_ids
            valid = min(shadow.num_computed_tokens, len(tokens) - 1)
            for position in range(self.num_verified[request.request_id], valid):
                if old[position] != tokens[position]:
                    valid = position
                    break
            shadow.all_token_ids = list(tokens)
            shadow.num_computed_tokens = valid
            self.kv_cache.trim(shadow, valid)
        self.num_verified[request.request_id] = request.num_tokens
        return shadow

    def _drop(self, request_id: str) -> None:
        self.kv_cache.free(self.shadows.pop(request_id))
        self.num_verified.pop(request_id, None)

    def _forward(self, shadows: list[Request]) -> None:
        """One draft forward: each shadow runs its uncomputed tokens and appends the draft
        model's greedy next token."""
        shadows = sorted(shadows, key=lambda s: s.num_tokens - s.num_computed_tokens != 1)
        num_new = [s.num_tokens - s.num_computed_tokens for s in shadows]
        scheduled = SchedulerOutput(
            requests=shadows,
            num_new_tokens=num_new,
            block_ids=[self.kv_cache.block_ids(s.request_id) for s in shadows],
            num_decodes=sum(1 for n in num_new if n == 1),
        )
        for shadow, n, sampled in zip(
            shadows, num_new, self.runner.execute_model(scheduled), strict=True
        ):
            shadow.num_computed_tokens += n
            shadow.append_token(sampled[0].token_id)
