"""One `StepBatch` per step (`engine/step_batch.py`): built once by the model runner from the
scheduler's output, its flat tensors (tokens, positions, padded block tables, logit rows),
whether the native step may run it, and both paths reading the one batch."""

from __future__ import annotations

import pytest
import torch

from nanollmserve import SamplingParams
from nanollmserve.engine import step_batch
from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.engine.request import Request
from nanollmserve.engine.scheduler import SchedulerOutput
from nanollmserve.engine.step_batch import StepBatch, StepSpan

pytestmark = pytest.mark.milestone("m28")


def request(
    request_id: str, prompt: list[int], computed: int, output: list[int] = (), **params
) -> Request:
    core = EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=16, **params))
    req = Request(core, eos_token_ids=set(), max_tokens=16)
    req.all_token_ids += output
    req.num_computed_tokens = computed
    return req


def scheduled_step() -> SchedulerOutput:
    """A decode (request a), a verify span of 2 drafts (b), a prefill chunk short of its
    prompt's end (c) and the last chunk of a prompt (d)."""
    a = request("a", [1, 2, 3], computed=3, output=[4])  # 4 tokens, 3 computed: decode
    b = request("b", [5, 6], computed=2, output=[7])  # last token 7 and drafts 8, 9
    c = request("c", list(range(10, 40)), computed=16)  # tokens 16..23 of 30
    d = request("d", list(range(40, 50)), computed=4)  # tokens 4..9 of 10: samples
    return SchedulerOutput(
        requests=[a, b, c, d],
        num_new_tokens=[1, 3, 8, 6],
        block_ids=[[3], [5], [7, 8], [9]],
        num_decodes=1,
        spec_token_ids={"b": [8, 9]},
    )


def test_the_scheduled_step_is_flattened_once():
    batch = StepBatch.of_scheduled(scheduled_step())
    assert batch.token_ids.tolist() == [4, 7, 8, 9, *range(26, 34), *range(44, 50)]
    assert batch.positions.tolist() == [3, 2, 3, 4, *range(16, 24), *range(4, 10)]
    assert batch.seq_of_token.tolist() == [0, 1, 1, 1] + [2] * 8 + [3] * 6
    assert batch.block_tables.tolist() == [[3, -1], [5, -1], [7, 8], [9, -1]]  # -1: no block
    # a's token, b's last token and both drafts, none of c, d's last token
    assert batch.logit_rows.tolist() == [0, 1, 2, 3, 17]
    assert batch.sample_rows == [0, 1, 3]
    assert batch.context_lens == [4, 5, 24, 10]
    assert batch.ends == [1, 4, 12, 18] and batch.num_tokens == 18
    assert [span.prefill for span in batch.spans] == [False, False, True, True]
    assert batch.num_decodes == 1 and batch.num_drafts == 2
    assert batch.prompt_rows is None
    assert batch.native_eligible and batch.kind == "batched-prefill"
    for tensor in (batch.token_ids, batch.positions, batch.block_tables, batch.logit_rows):
        assert tensor.dtype == torch.int64


def test_the_kind_of_a_step():
    scheduled = scheduled_step()
    one = SchedulerOutput(
        requests=scheduled.requests[:1],
        num_new_tokens=[1],
        block_ids=[[3]],
        num_decodes=1,
    )
    assert StepBatch.of_scheduled(one).kind == "decode"
    two = SchedulerOutput(
        requests=scheduled.requests[:2],
        num_new_tokens=[1, 3],
        block_ids=[[3], [5]],
        num_decodes=1,
        spec_token_ids={"b": [8, 9]},
    )
    assert StepBatch.of_scheduled(two).kind == "batched-verify"


def test_native_eligibility_is_a_property_of_the_batch(monkeypatch):
    assert StepBatch.of_scheduled(scheduled_step()).native_eligible
    long_prompt = request("p", list(range(600)), computed=0)
    chunk = SchedulerOutput(requests=[long_prompt], num_new_tokens=[257], block_ids=[[0] * 17])
    assert not StepBatch.of_scheduled(chunk).native_eligible  # a prefill chunk past 256
    monkeypatch.setattr(step_batch, "NATIVE_PREFILL_MAX_TOKENS", 257)
    assert StepBatch.of_scheduled(chunk).native_eligible
    monkeypatch.setattr(step_batch, "NATIVE_MAX_TOKENS", 256)
    assert not StepBatch.of_scheduled(chunk).native_eligible  # the step past its tokens
    scored = request("s", list(range(8)), computed=0, prompt_logprobs=1)
    prompt_logprobs = SchedulerOutput(requests=[scored], num_new_tokens=[8], block_ids=[[0]])
    batch = StepBatch.of_scheduled(prompt_logprobs)
    assert batch.prompt_rows is not None and not batch.native_eligible


@pytest.mark.parametrize(
    ("spans", "message"),
    [
        ([], "at least one sequence"),
        ([StepSpan([], 0, [0], 0)], "at least one token"),
        ([StepSpan([1, 2], 0, [0], 3)], "num_logits"),
        ([StepSpan([1, 2], 0, [0], -1)], "num_logits"),
    ],
)
def test_a_batch_that_cannot_be_described_is_refused(spans, message):
    with pytest.raises(ValueError, match=message):
        StepBatch.of(spans)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("native", [True, False])
def test_each_step_builds_one_batch_that_its_path_reads(make_llm, monkeypatch, native):
    """Native step or forward: `StepBatch.of_scheduled` runs once per step, and the batch it
    returned is the one the native step receives (or the forward's inputs are made from)."""
    llm = make_llm(quantization="gguf", block_size=16)
    runner = llm.engine.model_runner
    if native and runner.native_decode is None:
        pytest.skip("the native step is not available here")
    if not native:
        runner.native_decode = None
    built, read = [], []
    of_scheduled = StepBatch.of_scheduled

    def counting(scheduled):
        built.append(of_scheduled(scheduled))
        return built[-1]

    monkeypatch.setattr(StepBatch, "of_scheduled", staticmethod(counting))
    if native:
        step = runner.native_decode
        runner.native_decode = lambda batch: read.append(batch) or step(batch)
    else:
        forward_inputs = runner._forward_inputs
        monkeypatch.setattr(
            runner, "_forward_inputs", lambda batch: read.append(batch) or forward_inputs(batch)
        )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate(["The quick brown fox", "1, 2, 3,"], params, use_tqdm=False)
    assert built and len(read) == len(built)
    assert all(a is b for a, b in zip(read, built, strict=True))
