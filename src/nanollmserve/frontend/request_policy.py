"""RequestPolicy: what every request is held to before any work, whichever frontend (HTTP,
gRPC, the offline `LLM`) sent it: the server's generation defaults for the sampling fields
the client left unset, the request limits (`--max-*`, `request_limits.py`) and
`n <= --max-num-seqs`.

It is built from the serve settings (`cli/serve.py`) and given to the `AsyncEngine`
constructor (the offline `LLM` builds one from its `request_limits`), which completes it for
its model (`for_model`: the `--generation-config` defaults of the model's folder, the
engine's `max_num_seqs`); nothing patches it later. `frontend/admission.py` applies it, so
no frontend can skip it; frontends apply it first thing (`Admission.check_params`, with the
fields their request left unset), before tokenizing or rendering a chat template, so a
request over a limit costs no work. Like vLLM's input processor, it lives engine side. No
torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from nanollmserve.errors import ParamError
from nanollmserve.generation_config import load_generation_defaults
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestPolicy:
    limits: RequestLimits = field(default_factory=RequestLimits)
    generation_defaults: Mapping[str, object] = field(default_factory=dict)
    """`--generation-config` defaults (SamplingParams field -> value) for unset fields."""
    max_num_seqs: int | None = None
    """Most sequences the engine runs at once: a request's `n` may not exceed it."""
    generation_config: str = "vllm"
    """`--generation-config auto|vllm|PATH`: where `for_model` takes the generation defaults
    from (vllm: none; auto: the model's generation_config.json)."""

    def for_model(self, model_dir: str | None, max_num_seqs: int) -> RequestPolicy:
        """This policy completed for a loaded model: the `generation_config` defaults read
        from its folder (unless given already) and the engine's `max_num_seqs` (unless
        set). UserError for a generation_config.json it cannot read."""
        defaults = self.generation_defaults
        if not defaults and self.generation_config != "vllm":
            defaults = load_generation_defaults(self.generation_config, model_dir)
        return dataclasses.replace(
            self,
            generation_defaults=dict(defaults),
            max_num_seqs=self.max_num_seqs if self.max_num_seqs is not None else max_num_seqs,
        )

    def apply(self, params: SamplingParams, unset: Collection[str] = ()) -> SamplingParams:
        """`params` with the generation defaults of the fields in `unset` (the ones the
        client left out), checked against the limits; ParamError naming the field beyond
        one. Applying it again to its own result changes nothing."""
        defaults = {k: v for k, v in self.generation_defaults.items() if k in unset}
        if defaults:
            params = dataclasses.replace(params, **defaults)
        self.limits.check_params(params)
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise ParamError(
                f"n is {params.n}, more than this server runs at once "
                f"(--max-num-seqs {self.max_num_seqs})",
                param="n",
            )
        return params
