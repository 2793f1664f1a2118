"""The model runner: owns the model and the KV tensors, turns a scheduled batch into tensors,
runs the forward pass and samples. It makes no decisions: the scheduler already has.

One KV allocation is made at start: `[2, num_layers, num_blocks, block_size, kv_heads,
head_dim]` in the KV cache dtype (`--kv-cache-dtype`: the model's, or 8-bit codes with a
float32 scale per token and KV head in `kv_scales`, `[2, num_layers, num_blocks, block_size,
kv_heads]`, `layers/kv_quant.py`); each attention layer gets views of its K and V planes
(and scales). On the CPU it is an anonymous memory map, which the kernel hands out
zero-filled and commits page by page as tokens are written: filling 1 GiB with `torch.zeros`
took 0.8 s of every start. Per step it builds the flat batch (input ids, positions, slot
mapping, block tables) with tensor ops over requests, never a Python loop over tokens, sets
the attention context, runs the model on the flat batch, computes logits only at the
positions that sample, and samples. A one-token step runs its matmuls on the CPU kernel that
is fastest for one row (`layers/cpu_matmul.py`); with the weights in GGUF blocks, a step
whose requests each run a few tokens (their next tokens, verify steps, short prefill chunks:
`StepBatch.native_eligible`) runs as a single native call instead (`engine/native_decode.py`).
Either way the step is worked out once, as a `StepBatch` (`engine/step_batch.py`: token
slices, positions, padded block tables, logit rows), which both paths read.

Failure isolation: what comes after the logits (sampling metadata, grammar masks, the
sampler) belongs to one request per row, so when it raises the step is sampled again request
by request and only the requests whose own rows raise fail (`RequestFailure`, finish reason
"error"). An exception in the forward pass cannot be traced to a request: it fails the step.
`NANOLLMSERVE_FAIL_SAMPLING_SEED=N` makes preparing the sampling of every request with
`seed` N raise, to test this.

Speculative decoding: a request with draft tokens in `scheduled.spec_token_ids` runs its last
token and its k drafts as one span; the target samples a token at each of those k + 1
positions and `engine/spec_decode/rejection_sampler.py` keeps the accepted prefix, so a
request may emit several tokens in one step. On the native step a verify span returns the
logits of all k + 1 positions.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from nanollmserve.engine.messages import RequestFailure, SampledToken, TokenLogprobs
from nanollmserve.engine.native_decode import NativeDecodeStep
from nanollmserve.engine.request import Request
from nanollmserve.engine.scheduler import SchedulerOutput
from nanollmserve.engine.spec_decode.rejection_sampler import num_accepted
from nanollmserve.engine.step_batch import StepBatch
from nanollmserve.engine.structured_output import GrammarBitmask
from nanollmserve.layers.attention import PagedAttention
from nanollmserve.layers.attention_context import (
    AttentionContext,
    PrefillSpan,
    additive_mask,
    get_context,
    reset_context,
    set_context,
)
from nanollmserve.layers.cpu_matmul import matmul_kernels_for
from nanollmserve.layers.kv_quant import SCALE_DTYPE, is_quantized, kv_cache_storage_dtype
from nanollmserve.layers.sampler import Penalties, Sampler, SamplerOutput, SamplingMetadata

logger = logging.getLogger(__name__)

FAIL_SAMPLING_SEED_ENV = "NANOLLMSERVE_FAIL_SAMPLING_SEED"


class InjectedSamplingFailure(RuntimeError):
    """Raised for requests with the seed in NANOLLMSERVE_FAIL_SAMPLING_SEED (fault-injection
    tests)."""


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_storage_dtype(kv_cache_dtype, dtype)
        self.block_size = block_size
        self.attention_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        first = self.attention_layers[0]
        self._kv_shape = (
            2, len(self.attention_layers), num_blocks, block_size, first.num_kv_heads,
            first.head_dim,
        )  # fmt: skip
        self.native_decode: NativeDecodeStep | None = None
        self.kv_scales: torch.Tensor | None = None
        self._allocate_kv_cache()
        if self.kv_scales is not None:
            logger.info(
                "KV cache: %d blocks of %d tokens, %s codes + %s scales (%.1f MiB)",
                *(num_blocks, block_size, self.kv_cache_dtype, SCALE_DTYPE),
                (self.kv_cache.nbytes + self.kv_scales.nbytes) / 2**20,
            )
        else:
            logger.info(
                "KV cache: %d blocks of %d tokens, %s (%.1f MiB)",
                *(num_blocks, block_size, self.kv_cache_dtype, self.kv_cache.nbytes / 2**20),
            )
        self.native_steps: Counter[str] = Counter()
        """Steps run by `native_decode`, by kind: decode, verify, prefill."""
        self.sampler = Sampler(seed=seed, device=device)
        self.grammar_bitmask = GrammarBitmask()
        self.step_sender: Callable[..., None] | None = None
        """Rank 0 of a tensor-parallel group: sends each step to the other ranks."""
        self._fail_sampling_seed = _parse_fail_seed(os.environ.get(FAIL_SAMPLING_SEED_ENV, ""))

    @torch.inference_mode()
    def execute_model(
        self, scheduled: SchedulerOutput
    ) -> list[list[SampledToken] | RequestFailure]:
        """The tokens each request emits: one, none (a prefill chunk short of the prompt's
        end) or, with draft tokens, the accepted drafts and one more; a `RequestFailure`
        for a request whose own sampling raised (`_sample`)."""
        batch = StepBatch.of_scheduled(scheduled)
        sample_rows = batch.sample_rows
        if self.native_decode is not None and batch.native_eligible:
            self.native_steps[batch.kind] += 1
            logits = self.native_decode(batch)
            logits = logits if sample_rows else None
        else:
            input_ids, positions, logits_indices = self._forward_inputs(batch)
            prompt_rows = batch.prompt_rows  # scored after the sampling rows
            if prompt_rows is not None:
                logits_indices = prompt_rows.with_positions(logits_indices, self.device)
            logits = self.run_model(input_ids, positions, logits_indices)
            if prompt_rows is not None:
                logits = prompt_rows.take(logits, batch.logit_rows.shape[0])
        if logits is None:
            return [[] for _ in scheduled.requests]
        # One logits row per sampled position: k + 1 for a request with k drafts.
        drafts = [
            scheduled.spec_token_ids.get(scheduled.requests[i].request_id, ()) for i in sample_rows
        ]
        sample_requests = [
            scheduled.requests[i]
            for i, d in zip(sample_rows, drafts, strict=True)
            for _ in range(len(d) + 1)
        ]
        # Row j of a request is masked by its grammar after its first j drafts.
        row_drafts = [d[:j] for d in drafts for j in range(len(d) + 1)]
        tokens = self._sample(logits, sample_requests, row_drafts)
        results: list[list[SampledToken] | RequestFailure] = [[] for _ in scheduled.requests]
        first = 0
        for row, draft in zip(sample_rows, drafts, strict=True):
            targets = tokens[first : first + len(draft) + 1]
            first += len(draft) + 1
            if isinstance(targets[0], RequestFailure):
                results[row] = targets[0]
                continue
            if draft:
                targets = targets[: num_accepted(draft, [t.token_id for t in targets]) + 1]
            results[row] = targets
        return results

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], row_drafts: list[list[int]]
    ) -> list[SampledToken | RequestFailure]:
        """One token per logits row (`requests[i]` is row i's request; a request's rows are
        consecutive). The whole batch is sampled at once; if that raises, the step is
        sampled again request by request, so a request whose own rows raise (bad
        metadata, a grammar matcher, the sampler) gets a `RequestFailure` on each of its
        rows and the others their tokens. Seeded requests' generators are rewound first,
        so they draw the same numbers as in a step where nothing failed."""
        seeded = {r: r.generator.get_state() for r in requests if r.generator is not None}
        try:
            return self._sample_rows(logits, requests, row_drafts)
        except Exception:
            logger.warning(
                "sampling the step raised; sampling its requests one by one", exc_info=True
            )
        for request in requests:
            state = seeded.get(request)
            if state is None:
                request.generator = None  # made (and drawn from) by the failed attempt
            else:
                request.generator.set_state(state)
        tokens: list[SampledToken | RequestFailure] = []
        start = 0
        while start < len(requests):
            request = requests[start]
            end = start + 1
            while end < len(requests) and requests[end] is request:
                end += 1
            try:
                rows = slice(start, end)
                tokens += self._sample_rows(logits[rows], requests[rows], row_drafts[rows])
            except Exception as exc:
                logger.exception("request %s failed while sampling", request.request_id)
                tokens += [RequestFailure(repr(exc))] * (end - start)
            start = end
        return tokens

    def _sample_rows(
        self, logits: torch.Tensor, requests: list[Request], row_drafts: list[list[int]]
    ) -> list[SampledToken]:
        """The sampling stage of some rows: metadata, grammar masks (in place), the draw."""
        meta = self._sampling_metadata(requests, logits.shape[1])
        self.grammar_bitmask.apply(logits, requests, row_drafts)
        return _to_sampled_tokens(self.sampler(logits, meta), requests)

    @torch.inference_mode()
    def run_model(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor | None,
        return_hidden: bool = False,
    ) -> torch.Tensor | None:
        """The forward pass over the flat batch (its attention context set) and the logits at
        `logits_indices` (None: a step that samples nothing), or with `return_hidden` the
        final normed hidden state of every token. Under tensor parallelism rank 0 first hands
        the step to `step_sender`, and every other rank runs this same method."""
        if self.step_sender is not None:
            self.step_sender(input_ids, positions, get_context(), logits_indices)
        with matmul_kernels_for(input_ids.shape[0], self.device, self.dtype):
            try:
                hidden = self.model(input_ids, positions)
            finally:
                reset_context()
            if return_hidden:
                return hidden
            if logits_indices is None:
                return None
            return self.model.compute_logits(hidden[logits_indices])

    @torch.inference_mode()
    def run_hidden_states(self, scheduled: SchedulerOutput) -> torch.Tensor:
        """The final normed hidden state of every scheduled token, in the flat batch's order:
        what the pooling runner pools (`engine/pooling.py`); no logits, nothing sampled."""
        input_ids, positions, _ = self._forward_inputs(StepBatch.of_scheduled(scheduled))
        return self.run_model(input_ids, positions, None, return_hidden=True)

    def _forward_inputs(
        self, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The PyTorch forward's view of the batch: its attention context set (where each
        token's K/V is written, the decodes' block tables and lengths, the prefill spans),
        and its input ids, positions and logits indices (None: nothing samples) on the
        device."""
        bs = self.block_size
        positions, block_tables = batch.positions, batch.block_tables
        slot_mapping = block_tables[batch.seq_of_token, positions // bs] * bs + positions % bs
        num_decodes = batch.num_decodes
        context = AttentionContext(
            slot_mapping=slot_mapping.to(self.device), num_decode_tokens=num_decodes
        )
        context_lens = batch.context_lens
        if num_decodes:
            decode_lens = torch.tensor(context_lens[:num_decodes])
            num_blocks = -(-max(context_lens[:num_decodes]) // bs)
            key_pos = torch.arange(num_blocks * bs)
            mask = additive_mask(key_pos[None, :] < decode_lens[:, None], self.dtype)
            tables = block_tables[:num_decodes, :num_blocks].clamp_min(0)  # -1 pads: block 0
            context.decode_block_tables = tables.to(self.device)
            context.decode_mask = mask.view(num_decodes, 1, 1, -1).to(self.device)
            context.decode_context_lens = decode_lens.to(self.device)
        for i in range(num_decodes, len(batch.spans)):
            span, query_end = batch.spans[i], batch.ends[i]
            query_start = query_end - len(span.token_ids)
            if span.position == 0:
                context.prefills.append(
                    PrefillSpan(query_start, query_end, query_end - query_start)
                )
            else:
                ctx_len = context_lens[i]
                block_ids = block_tables[i, : -(-ctx_len // bs)].to(self.device)
                context.prefills.append(
                    PrefillSpan.over_cache(query_start, query_end, ctx_len, block_ids, self.dtype)
                )
        set_context(context)
        logits_indices = batch.logit_rows.to(self.device) if batch.sample_rows else None
        return batch.token_ids.to(self.device), positions.to(self.device), logits_indices

    def _sampling_metadata(self, requests: list[Request], vocab_size: int) -> SamplingMetadata:
        params = [r.sampling_params for r in requests]
        if self._fail_sampling_seed is not None:
            failing = [r for r in requests if r.sampling_params.seed == self._fail_sampling_seed]
            if failing:
                raise InjectedSamplingFailure(f"{failing[0].request_id} ({FAIL_SAMPLING_SEED_ENV})")
        dev = self.device
        meta = SamplingMetadata(
            # 0 marks a greedy row, also one whose temperature is below SAMPLING_EPS
            temperature=torch.tensor(
                [0.0 if p.is_greedy else p.temperature for p in params], device=dev
            ),
            all_greedy=all(p.is_greedy for p in params),
        )
        if any(p.top_k > 0 for p in params):
            meta.top_k = torch.tensor([p.top_k for p in params], device=dev)
            meta.max_top_k = max(p.top_k for p in params)
        if any(p.top_p < 1.0 for p in params):
            meta.top_p = torch.tensor([p.top_p for p in params], device=dev)
        if any(p.min_p > 0.0 for p in params):
            meta.min_p = torch.tensor([p.min_p for p in params], device=dev)
        for row, (request, p) in enumerate(zip(requests, params, strict=True)):
            if p.seed is not None and not p.is_greedy:
                if request.generator is None:
                    request.generator = torch.Generator(device=dev)
                    request.generator.manual_seed(p.seed)
                meta.generators[row] = request.generator
        meta.penalties = _penalties(requests, vocab_size, dev)
        bias = [
            (row, t, v) for row, p in enumerate(params) for t, v in (p.logit_bias or {}).items()
        ]
        if bias:
            rows, tokens, values = zip(*bias, strict=True)
            meta.bias_index = (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev))
            meta.bias_values = torch.tensor(values, device=dev)
        blocked = [
            (row, t)
            for row, (r, p) in enumerate(zip(requests, params, strict=True))
            if r.num_output_tokens < p.min_tokens
            for t in r.min_tokens_blocked_ids
        ]
        if blocked:
            rows, tokens = zip(*blocked, strict=True)
            meta.blocked_index = (torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            meta.max_num_logprobs = max(wanted)
        return meta

    # -- sleep mode (`engine_core.py`: EngineCore.sleep) ---------------------------------------
    @property
    def kv_cache_released(self) -> bool:
        return self.kv_cache is None

    def _allocate_kv_cache(self) -> None:
        """A zeroed KV pool in the KV cache dtype (with its zeroed scales when quantized)
        bound to the layers (views of its K and V planes and scales), and the native step
        built on its addresses: a step of decode tokens, verify spans and short prefill
        chunks, of one request or several, runs as one native call when the model allows it
        (and the step's batch: `StepBatch.native_eligible`)."""
        self.kv_cache = zeroed_tensor(self._kv_shape, self.kv_cache_dtype, self.device)
        if is_quantized(self.kv_cache_dtype):
            self.kv_scales = zeroed_tensor(self._kv_shape[:-1], SCALE_DTYPE, self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
            if self.kv_scales is not None:
                layer.k_scale = self.kv_scales[0, i]
                layer.v_scale = self.kv_scales[1, i]
        num_blocks, block_size = self._kv_shape[2:4]
        self.native_decode = NativeDecodeStep.for_model(self.model, num_blocks * block_size)

    def release_kv_cache(self) -> None:
        """Free the KV pool: drop every view of it (the layers' K/V planes, the native step,
        which holds raw pointers into it), so its memory map is unmapped and the process's
        RSS falls by what was committed of it. Its contents are lost."""
        self.native_decode = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
            layer.k_scale = layer.v_scale = None
        self.kv_cache = self.kv_scales = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reallocate_kv_cache(self) -> None:
        """A fresh zeroed KV pool of the released one's shape and dtype, bound to the layers
        again, and the native step rebuilt on its new addresses."""
        self._allocate_kv_cache()


def _parse_fail_seed(value: str) -> int | None:
    try:
        return int(value) if value.strip() else None
    except ValueError:
        logger.warning("ignoring %s=%r: not an integer seed", FAIL_SAMPLING_SEED_ENV, value)
        return None


def _penalties(requests: list[Request], vocab_size: int, device) -> Penalties | None:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if not rows:
        return None
    prompts = [requests[i].prompt_token_ids for i in rows]
    outputs = [requests[i].output_token_ids for i in rows]
    params = [requests[i].sampling_params for i in rows]

    def padded(seqs: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(s) for s in seqs))
        return torch.tensor([s + [vocab_size] * (width - len(s)) for s in seqs], device=device)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device)[:, None]

    return Penalties(
        rows=torch.tensor(rows, device=device),
        prompt_ids=padded(prompts),
        output_ids=padded(outputs),
        repetition=column([p.repetition_penalty for p in params]),
        presence=column([p.presence_penalty for p in params]),
        frequency=column([p.frequency_penalty for p in params]),
    )


def _to_sampled_tokens(out: SamplerOutput, requests: list[Request]) -> list[SampledToken]:
    """The step's one host sync: move the sampled ids (and logprobs) to Python."""
    token_ids = out.token_ids.tolist()
    if out.logprobs is None:
        return [SampledToken(t) for t in token_ids]
    logprobs, lp_ids, ranks = (
        out.logprobs.tolist(),
        out.logprob_token_ids.tolist(),
        out.ranks.tolist(),
    )
    tokens = []
    for i, (request, token_id) in enumerate(zip(requests, token_ids, strict=True)):
        k = request.sampling_params.logprobs
        entry = None
        if k is not None:
            entry = TokenLogprobs(
                token_ids=lp_ids[i][: 1 + k],
                logprobs=logprobs[i][: 1 + k],
                ranks=[ranks[i]] + list(range(1, k + 1)),
            )
        tokens.append(SampledToken(token_id, entry))
    return tokens


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU backed by an anonymous memory map (zero-filled by the kernel,
    its pages committed only when written), so allocating the KV pool costs no time."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # as bytes first: frombuffer takes no float8 dtype
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)
