"""RequestPolicy: what every request is held to before any work, whichever frontend (HTTP,
gRPC) sent it: the server's generation defaults for the sampling fields the client left
unset, the request limits (`--max-*`, `request_limits.py`) and `n <= --max-num-seqs`.

The AsyncEngine holds one (`AsyncEngine.request_policy`, set by the server from its
settings) and applies it in `add_request`, so no frontend can skip it; frontends also apply
it first thing (with the fields their request left unset), before tokenizing or rendering a
chat template, so a request over a limit costs no work. Like vLLM's input processor, it lives
engine side. No torch here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from nanollmserve.errors import ParamError
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestPolicy:
    limits: RequestLimits = field(default_factory=RequestLimits)
    generation_defaults: Mapping[str, object] = field(default_factory=dict)
    """`--generation-config` defaults (SamplingParams field -> value) for unset fields."""
    max_num_seqs: int | None = None
    """Most sequences the engine runs at once: a request's `n` may not exceed it."""

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
