"""The offline API: `LLM(model).generate(prompts, SamplingParams(...)) -> list[RequestOutput]`.

It drives the same EngineDriver as the server's engine thread, synchronously: add every
request, step the engine until all are done, return the outputs (FINAL_ONLY: one per
request) in prompt order. `LLM.chat` applies the model's chat template first. Each prompt is
one request, admitted as the server admits one (`frontend/admission.py`): the same request
policy and limits (`request_limits`, the defaults of `nanollmserve serve`'s `--max-*`
flags unless given) and the same model limits, so a request the server refuses with a 400
raises the same `ParamError` (a ValueError) here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from nanollmserve.config import EngineConfig
from nanollmserve.engine.engine_core import EngineCore
from nanollmserve.frontend.admission import Admission, AdmittedRequest
from nanollmserve.frontend.engine_driver import EngineDriver
from nanollmserve.frontend.input_processor import InputProcessor
from nanollmserve.frontend.request_policy import RequestPolicy
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids, load_tokenizer
from nanollmserve.lora_request import LoRARequest
from nanollmserve.outputs import OutputKind, RequestOutput
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        request_limits: RequestLimits | None = None,
        **engine_args,
    ) -> None:
        """`engine_args`: EngineConfig fields. `request_limits`: the bounds on one request
        (`nanollmserve serve`'s `--max-*` flags; default: their defaults)."""
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.config.tokenizer or self.engine.loaded.model_dir)
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.engine.max_model_len,
            self.engine.model_config.vocab_size,
            self.engine.eos_token_ids,
            scheduling_policy=self.config.scheduling_policy,
            pooling=self.config.runner == "pooling",
            max_client_priority=self.config.max_client_priority,
        )
        policy = RequestPolicy(request_limits or RequestLimits())
        self.admission = Admission(
            policy.for_model(None, self.config.max_num_seqs), self.input_processor
        )
        self.driver = EngineDriver(self.engine, self.tokenizer)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks and leave their group (nothing to do with one
        rank); the LLM cannot generate after it. `with LLM(...) as llm:` calls it on exit."""
        self.engine.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the KV cache and the weights (level 2) until
        `wake_up` (vLLM's `LLM.sleep`; docs/features/sleep-mode.md). Cached prefixes are
        forgotten; generating while asleep raises ValueError."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Reload what `sleep` freed (the weights from the model source at level 2)."""
        self.engine.wake_up()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); one RequestOutput per prompt, in order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); an adapter is loaded the first time its name is seen (needs enable_lora).
        `priority`: one per prompt, lower first (needs scheduling_policy="priority"); it
        overrides the sampling params' `priority`."""
        self._check_runner(pooling=False)
        prompt_list = _as_prompt_list(prompts)
        lora_names = self._lora_names(lora_request, len(prompt_list))
        params_list = _as_params_list(sampling_params, len(prompt_list))
        if priority is not None:
            priority = list(priority)
            if len(priority) != len(prompt_list):
                raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
            params_list = [
                dataclasses.replace(params, priority=value)
                for params, value in zip(params_list, priority, strict=True)
            ]
        tokenized = [self.input_processor.tokenize(p) for p in prompt_list]
        return self._run(tokenized, params_list, use_tqdm, lora_names)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        use_tqdm: bool = True,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or several.
        `chat_template_kwargs`: more template variables (`{"enable_thinking": False}`);
        `continue_final_message`: the last (assistant) message stays open (vLLM's)."""
        self._check_runner(pooling=False)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "template_kwargs": chat_template_kwargs,
        }
        tokenized = [
            (None, chat_prompt_token_ids(self.tokenizer, conv, chat_template, **options))
            for conv in conversations
        ]
        return self._run(tokenized, sampling_params, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Embed each prompt (text or token ids) with a pooling engine (`runner="pooling"`):
        one RequestOutput per prompt, in order, its vector in `outputs[0].embedding`.
        `lora_request`: as in `generate`."""
        self._check_runner(pooling=True)
        prompt_list = _as_prompt_list(prompts)
        lora_names = self._lora_names(lora_request, len(prompt_list))
        tokenized = [self.input_processor.tokenize(p) for p in prompt_list]
        return self._run(tokenized, SamplingParams(max_tokens=None), use_tqdm, lora_names)

    def _check_runner(self, pooling: bool) -> None:
        if pooling and self.config.runner != "pooling":
            raise ValueError("LLM.embed needs LLM(runner='pooling') (or task='embed')")
        if not pooling and self.config.runner == "pooling":
            raise ValueError("a pooling LLM (runner='pooling') embeds: use LLM.embed")

    def _lora_names(self, lora_request, count: int) -> list[str | None]:
        """One adapter name (or None) per prompt; loads the adapters not loaded yet."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_requests = [lora_request] * count
        else:
            lora_requests = list(lora_request)
            if len(lora_requests) != count:
                raise ValueError(f"got {len(lora_requests)} LoRA requests for {count} prompts")
        manager = self.engine.lora_manager
        if manager is None and any(r is not None for r in lora_requests):
            raise ValueError("lora_request needs LLM(enable_lora=True)")
        for request in {r for r in lora_requests if r is not None}:
            loaded = manager.adapters().get(request.lora_name)
            if loaded is None:
                manager.add_adapter(request.lora_name, request.lora_path)
            elif loaded != str(request.lora_path):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} is already loaded from {loaded}, "
                    f"not {request.lora_path}"
                )
        return [None if r is None else r.lora_name for r in lora_requests]

    def _run(
        self, tokenized, sampling_params, use_tqdm: bool, lora_names=None
    ) -> list[RequestOutput]:
        params_list = _as_params_list(sampling_params, len(tokenized))
        lora_names = lora_names or [None] * len(tokenized)
        order: dict[str, int] = {}
        staged: list[AdmittedRequest] = []
        for (prompt, token_ids), params, lora_name in zip(
            tokenized, params_list, lora_names, strict=True
        ):
            request_id = str(next(self._request_counter))
            staged.append(
                self.admission.admit(
                    request_id,
                    prompt,
                    token_ids,
                    params,
                    output_kind=OutputKind.FINAL_ONLY,
                    lora_name=lora_name,
                )
            )
        # Everything admitted: now run, so a bad prompt never leaves others half-run.
        try:
            for request in staged:
                self.driver.add_request(request)
                order[request.request_id] = len(order)
        except BaseException:
            self._abort(order)
            raise

        results: list[RequestOutput | None] = [None] * len(order)
        progress = tqdm(total=len(order), desc="Generating", disable=not use_tqdm or len(order) < 2)
        try:
            while self.driver.has_unfinished_requests():
                for output in self.driver.step().outputs:
                    results[order[output.request_id]] = output
                    progress.update(1)
        finally:
            progress.close()
            self._abort(rid for rid, i in order.items() if results[i] is None)
        return results

    def _abort(self, request_ids) -> None:
        for request_id in list(request_ids):
            self.driver.abort_request(request_id)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
