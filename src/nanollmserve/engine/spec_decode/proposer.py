"""The speculative decoding step of the engine: which requests may get drafts, how many, and
which proposer makes them (`--speculative-config`).

Before each step, every running request that is decoding gets up to k drafts in
`Request.spec_token_ids`. A request gets fewer when it is close to `max_tokens` (k accepted
drafts plus the target's own token must fit) and none when its drafts could not be checked
exactly by sampling each position independently: repetition/presence/frequency penalties
and min_tokens (both depend on the tokens before each position). A request with structured
output keeps the drafts up to the first one its grammar refuses (the target could never
sample that one), and the model runner masks each verified position with the grammar state
after the drafts before it (`GrammarBitmask.apply`), so the grammar holds at every token.
"""

from __future__ import annotations

from dataclasses import replace

from nanollmserve.config import EngineConfig
from nanollmserve.engine.model_loading import LoadedModel, load_engine_model
from nanollmserve.engine.model_runner import ModelRunner
from nanollmserve.engine.request import Request
from nanollmserve.engine.spec_decode.draft_model_proposer import DraftModelProposer
from nanollmserve.engine.spec_decode.ngram_proposer import NgramProposer
from nanollmserve.errors import UserError
from nanollmserve.speculative_config import SpeculativeConfig


def make_speculative_decoder(
    config: EngineConfig, target: LoadedModel, num_blocks: int
) -> SpeculativeDecoder | None:
    """The engine's speculative decoder from `config.speculative_config` (None: off). A draft
    model is loaded on the target's device and dtype; its KV cache gets as many blocks."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return SpeculativeDecoder(spec, ngram)
    draft = load_engine_model(
        replace(
            config,
            model=spec.model,
            dtype=str(target.dtype).removeprefix("torch."),
            speculative_config=None,
            quantization=None,
        )
    )
    if draft.model_config.vocab_size != target.model_config.vocab_size:
        raise UserError(
            f"the draft model's vocabulary ({draft.model_config.vocab_size} tokens) differs "
            f"from the target's ({target.model_config.vocab_size}): use a draft model with "
            "the same tokenizer"
        )
    runner = ModelRunner(
        draft.model, num_blocks, config.block_size, draft.device, draft.dtype, config.seed
    )
    proposer = DraftModelProposer(
        runner, num_blocks, config.block_size, draft.model_config.max_context_len
    )
    return SpeculativeDecoder(spec, proposer)


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: NgramProposer | DraftModelProposer):
        self.config = config
        self.proposer = proposer

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of this step on the running requests."""
        k = self.config.num_speculative_tokens
        num_drafts = [num_drafts_for(r, k) for r in running]
        for request, drafts in zip(
            running, self.proposer.propose(running, num_drafts), strict=True
        ):
            if request.grammar is not None and drafts:
                drafts = drafts[: request.grammar.num_valid(drafts)]
            request.spec_token_ids = drafts

    def reset(self) -> None:
        """Forget every request (after the engine's own reset)."""
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.reset()


def num_drafts_for(request: Request, k: int) -> int:
    """How many drafts `request` may get this step (0: decode one token as usual)."""
    if request.num_tokens - request.num_computed_tokens != 1:  # its prompt is not done
        return 0
    params = request.sampling_params
    if params.needs_penalties or request.num_output_tokens < params.min_tokens:
        return 0
    return max(0, min(k, request.max_tokens - request.num_output_tokens - 1))
