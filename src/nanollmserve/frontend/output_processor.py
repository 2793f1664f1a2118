"""From engine outputs (token ids) to RequestOutputs (text), one state per request.

A request asking for `n` completions runs in the engine as `n` child requests; their
outputs are gathered here into one RequestOutput with `n` CompletionOutputs. Prompt logprobs
come once per request, from child 0 (the only one that computes them). Each child has
an incremental detokenizer; stop strings are found here, in text, across token boundaries,
and a child that hits one is reported back so the caller aborts it in the engine. As in
vLLM, stop strings are only looked for once a child has more than `min_tokens` tokens.
While a child runs, its visible text holds back the last `len(longest stop) - 1`
characters, which might still turn out to be the start of a stop string, so streamed deltas
never have to be taken back.

What a request gets back depends on its `OutputKind`: DELTA requests get, each step they
change, only the text, tokens and logprobs not sent before; FINAL_ONLY requests get one
output when they end. Every ended request also yields a full final output for observers
(metrics), built once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanollmserve.engine.messages import EngineCoreOutput, TokenLogprobs
from nanollmserve.frontend.admission import AdmittedRequest
from nanollmserve.frontend.detokenizer import IncrementalDetokenizer
from nanollmserve.outputs import (
    CompletionOutput,
    Logprob,
    OutputKind,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from nanollmserve.sampling_params import SamplingParams


class ChildState:
    """One completion: its tokens, its text so far, and why it stopped."""

    def __init__(self, index: int, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        # What DELTA outputs have sent so far.
        self.num_sent_chars = 0
        self.num_sent_tokens = 0
        self.finish_sent = False
        self.embedding: list[float] | None = None  # a pooling engine's, with the finish

    def add(self, out: EngineCoreOutput) -> bool:
        """Take one engine output; True when a stop string finished this child here. Stop
        strings are checked token by token, so tokens after the one completing a stop
        string (several arrive at once with speculative decoding) are dropped."""
        for i, token_id in enumerate(out.new_token_ids):
            text_len_before = len(self.text)
            self.token_ids.append(token_id)
            self.text += self.detokenizer.add_token(token_id)
            if self.logprobs is not None and out.new_logprobs:
                self._add_logprobs(out.new_logprobs[i])
            if (
                self.params.stop
                and len(self.token_ids) > self.params.min_tokens
                and self._find_stop_string(text_len_before)
            ):
                return not out.finished
        if out.pooled is not None:
            self.embedding = out.pooled
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def visible_text(self) -> str:
        if self.finish_reason is None and self.max_stop_len > 1:
            return self.text[: max(0, len(self.text) - (self.max_stop_len - 1))]
        return self.text

    def to_output(self) -> CompletionOutput:
        """Everything so far."""
        return CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            embedding=self.embedding,
        )

    def delta(self) -> CompletionOutput | None:
        """What was not sent yet (None if nothing), and marks it sent."""
        if self.finish_sent:
            return None
        text = self.visible_text()[self.num_sent_chars :]
        first = self.num_sent_tokens
        finished = self.finish_reason is not None
        if not text and len(self.token_ids) == first and not finished:
            return None
        self.num_sent_chars += len(text)
        self.num_sent_tokens = len(self.token_ids)
        self.finish_sent = finished
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[first:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs[first:] if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            embedding=self.embedding,
        )

    def _find_stop_string(self, text_len_before: int) -> bool:
        # A new match must end in the new text, so it starts at most len(stop) - 1 before it.
        search_from = max(0, text_len_before - self.max_stop_len + 1)
        best = None
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        end = at + len(stop) if self.params.include_stop_str_in_output else at
        self.text = self.text[:end]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _add_logprobs(self, entry: TokenLogprobs) -> None:
        self.logprobs.append(decode_logprobs(self.tokenizer, entry))
        self.cumulative_logprob += entry.logprobs[0]


def decode_logprobs(tokenizer, entry: TokenLogprobs) -> dict[int, Logprob]:
    """One token's logprobs with each token's text (the scored token first)."""
    decoded = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True):
        if token_id not in decoded:
            text = tokenizer.decode([token_id])
            decoded[token_id] = Logprob(logprob=logprob, rank=rank, decoded_token=text)
    return decoded


@dataclass
class RequestState:
    """One user request (a parent of `n` children) and its metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[ChildState]
    metrics: RequestMetrics
    output_kind: OutputKind
    child_ids: list[str] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    """A DELTA consumer got them already."""

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    @property
    def awaits_prompt_logprobs(self) -> bool:
        """It wants prompt logprobs and child 0, which alone computes them, is running and
        has not brought them yet: a DELTA consumer gets nothing meanwhile, so the first
        output of every choice carries them (a sibling that took a prefix-cache hit may
        sample its first token before child 0 has scored the whole prompt)."""
        first = self.children[0]
        return (
            first.params.prompt_logprobs is not None
            and self.prompt_logprobs is None
            and first.finish_reason is None
        )

    def final_output(self) -> RequestOutput:
        """Everything, every choice."""
        return self._output([c.to_output() for c in self.children], self.prompt_logprobs)

    def next_output(self) -> RequestOutput | None:
        """What the consumer gets now, by output kind (None: nothing for it this step)."""
        if self.output_kind is OutputKind.FINAL_ONLY:
            return self.final_output() if self.finished else None
        if self.awaits_prompt_logprobs:
            return None
        deltas = [d for c in self.children if (d := c.delta()) is not None]
        if not deltas and not self.finished:
            return None
        prompt_logprobs = None if self.prompt_logprobs_sent else self.prompt_logprobs
        self.prompt_logprobs_sent = self.prompt_logprobs is not None
        return self._output(deltas, prompt_logprobs)

    def _output(self, outputs: list[CompletionOutput], prompt_logprobs=None) -> RequestOutput:
        return RequestOutput(
            prompt_logprobs=prompt_logprobs,
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.metrics.num_cached_tokens,
            metrics=self.metrics,
        )


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    """For the consumers: per request that changed this step, its delta or, when it ended,
    its final output (by its output kind)."""
    finished_outputs: list[RequestOutput]
    """The full final output of every request that ended this step (for observers)."""
    child_ids_to_abort: list[str]
    """Children that hit a stop string: the caller aborts them in the engine."""


@dataclass
class AbortedRequest:
    running_child_ids: list[str]
    """Children still running in the engine: the caller aborts them there."""
    output: RequestOutput
    """The consumer's last output (by its output kind), `finished`, reasons "abort"."""
    final_output: RequestOutput
    """The full final output (for observers)."""


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, tuple[RequestState, int]] = {}

    def add_request(self, request: AdmittedRequest) -> None:
        """Track an admitted request: one ChildState per engine request (`n`)."""
        prompt_token_ids, child_ids = request.prompt_token_ids, request.child_ids
        children = [
            ChildState(i, self.tokenizer, prompt_token_ids, request.params)
            for i in range(len(child_ids))
        ]
        state = RequestState(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=prompt_token_ids,
            children=children,
            metrics=RequestMetrics(request.arrival_time, num_prompt_tokens=len(prompt_token_ids)),
            output_kind=request.output_kind,
            child_ids=child_ids,
        )
        self.requests[request.request_id] = state
        for i, child_id in enumerate(child_ids):
            self.child_to_parent[child_id] = (state, i)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.time()
        touched: dict[str, RequestState] = {}
        to_abort = []
        for out in engine_outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:
                continue  # already finished here (e.g. stopped by a stop string)
            state, index = entry
            child = state.children[index]
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                entries = [decode_logprobs(self.tokenizer, e) for e in out.prompt_logprobs]
                state.prompt_logprobs = [None, *entries]
            if child.add(out):
                to_abort.append(out.request_id)
            self._update_metrics(state.metrics, out, now, first_child=index == 0)
            if child.finish_reason is not None:
                del self.child_to_parent[out.request_id]
            touched[state.request_id] = state
        results, finished = [], []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
                finished.append(state.final_output())
            output = state.next_output()
            if output is not None:
                results.append(output)
        return ProcessedOutputs(results, finished, to_abort)

    def abort_request(self, request_id: str) -> AbortedRequest | None:
        """Finish a request as aborted (None if it is not here any more)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        running = []
        for child_id, child in zip(state.child_ids, state.children, strict=True):
            if child.finish_reason is None:
                child.finish_reason = "abort"
                running.append(child_id)
            self.child_to_parent.pop(child_id, None)
        state.metrics.finished_time = time.time()
        return AbortedRequest(running, state.next_output(), state.final_output())

    @staticmethod
    def _update_metrics(m: RequestMetrics, out: EngineCoreOutput, now: float, first_child: bool):
        if out.first_scheduled_time is not None and (
            m.first_scheduled_time is None or out.first_scheduled_time < m.first_scheduled_time
        ):
            m.first_scheduled_time = out.first_scheduled_time
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
        if first_child:
            m.num_cached_tokens = out.num_cached_tokens
            m.num_preemptions = out.num_preemptions
