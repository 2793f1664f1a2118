"""From what a user sends (text, token ids) to EngineCoreRequests: tokenizing (a bad prompt
raises `ParamError` naming it), compiling a request's grammar, and the `n` child requests of
an admitted request. The checks of a request's parameters and limits are `admission.py`'s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from nanollmserve.engine.grammar_compiler import GrammarCompiler
from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_output_limits import StructuredOutputLimits


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt tokenized already (`AsyncEngine.tokenize` of the text or ids): what a
    request's prompts become before any of them is admitted, so the request's totals
    (`RequestLimits.check_prompts`) are checked first; `tokenize` passes it through."""

    text: str | None
    token_ids: list[int]


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        stop_token_ids=frozenset(),
        grammar_limits: StructuredOutputLimits | None = None,
        scheduling_policy: str = "fcfs",
        pooling: bool = False,
        max_client_priority: int | None = None,
    ) -> None:
        """`grammar_limits`: the size limits of a request's grammar (None: none, offline).
        `scheduling_policy`: the engine's; under fcfs a non-zero `priority` is refused.
        `pooling`: the engine pools (`runner="pooling"`): a prompt needs no room for output.
        `max_client_priority`: the lowest `priority` a request may ask (None: any)."""
        self.tokenizer = tokenizer
        self.max_client_priority = max_client_priority
        self.pooling = pooling
        self.scheduling_policy = scheduling_policy
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Structured output ends on the model's stop tokens (its EOS ids).
        stop_ids = sorted(stop_token_ids) or [tokenizer.eos_token_id]
        self.grammar_compiler = GrammarCompiler(tokenizer, vocab_size, stop_ids, grammar_limits)

    def tokenize(
        self, prompt: str | list[int | str] | TokenizedPrompt
    ) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, prompt token ids). A list with strings among its
        token ids is llama.cpp's mixed prompt (the embedding routes take it): `_pieces`."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt.text, prompt.token_ids
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt must not be empty", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if any(isinstance(t, str) for t in token_ids):
            token_ids = self._pieces(token_ids)
        if not token_ids:
            raise ParamError("prompt must not be empty", "prompt")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise ParamError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt"
            )
        return None, token_ids

    def _pieces(self, pieces: list[int | str]) -> list[int]:
        """The token ids of llama.cpp's mixed prompt: each id as is (checked by `tokenize`),
        each string's tokens in its place, with the tokenizer's special tokens (BOS) only
        for a string that comes first, as llama.cpp's `tokenize_mixed`. At most the context
        length in pieces (each id is a token), so a hostile list of many short strings is
        refused before it is tokenized piece by piece."""
        limit = self.max_model_len
        if len(pieces) > limit:
            raise ParamError(
                f"a prompt of token ids and strings may have at most {limit} pieces (this "
                f"model's context length), got {len(pieces)}: the prompt is too large",
                "prompt",
            )
        token_ids: list = []
        for i, piece in enumerate(pieces):
            if not isinstance(piece, str):
                token_ids.append(piece)
            elif piece:
                token_ids += self.tokenizer.encode(piece, add_special_tokens=i == 0)
        return token_ids

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_name: str | None = None,
        grammar=None,
    ) -> list[EngineCoreRequest]:
        """One engine request per completion (`n`); child i of a seeded request uses seed + i.
        Prompt logprobs are the prompt's, the same for every child: only child 0 asks for
        them, so they are computed once per request (the output processor gives them to
        every choice), and the other children, free to take prefix-cache hits, reuse the
        prompt blocks child 0 computes in the same step. `lora_name`: the LoRA adapter they
        all run with (None: the base model). `grammar`: `params.structured_outputs`
        compiled. The request passed its checks already (`Admission.admit` calls this)."""
        arrival_time = time.time() if arrival_time is None else arrival_time
        if params.n == 1:
            return [
                EngineCoreRequest(
                    request_id, prompt_token_ids, params, arrival_time, lora_name, grammar=grammar
                )
            ]
        requests = []
        for i in range(params.n):
            child_params = dataclasses.replace(params, n=1)
            if i > 0:
                child_params.prompt_logprobs = None  # child 0's serve every choice
            if params.seed is not None:
                child_params.seed = params.seed + i
            requests.append(
                EngineCoreRequest(
                    child_id(request_id, i),
                    prompt_token_ids,
                    child_params,
                    arrival_time,
                    lora_name,
                    grammar=grammar,
                )
            )
        return requests

    def compile_grammar(self, params: SamplingParams, param: str = "structured_outputs"):
        """The compiled grammar of `params.structured_outputs` (None without one); a schema,
        regex or grammar the engine cannot compile raises ParamError naming `param`."""
        if params.structured_outputs is None:
            return None
        return self.grammar_compiler.compile(params.structured_outputs, param)


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"
