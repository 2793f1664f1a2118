"""The decoder options the native step implements, and the one check that refuses the rest.

The model declares every option that changes its math in one dataclass (`DecoderOptions`,
`model/decoder_options.py`); the native step states here, by field name, which of them
`nls_decode_step` computes (each with a parity test against the PyTorch forward). Any field
whose value differs from its default and is not named here is refused at load with its name
and value: a field added to the model later is refused until the C step implements it and it
is added to `SUPPORTED`, never decoded wrong in silence. No `if` per field: one comparison
over the dataclass's fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED = frozenset(
    {
        "qkv_bias",  # added to the fused q/k/v product
        "o_bias",  # added with the attention output's residual
        "mlp_bias",  # added to the gate/up product and with the down product's residual
        "qk_norm",  # RMSNorm of each q and k head before the rotation
        "tie_word_embeddings",  # the output projection's blocks, or the model's compute_logits
        "rope_scaling",  # the model's cos/sin table, scaling baked in, is what the step reads
        "norm_offset",  # folded into the norm scales at declaration (`offset + w`, Gemma's 1 + w)
        "query_pre_attn_scalar",  # the step reads the attention's own scale (`attn_scale`)
        "activation",  # SiLU or tanh-GELU and mul (`nls_model.activation`)
        "embed_scale",  # the looked-up embeddings times it (`nls_model.embed_scale`)
        "sandwich_norms",  # the attention and MLP outputs normed before their residual adds
        "sliding_window",  # a sliding layer's attention reads its last `window` keys
        "layer_types",  # which layers slide: each layer declares its own window
        "local_rope_theta",  # a sliding layer's own cos/sin table (`nls_layer.rope`)
        "final_logit_softcap",  # after a native lm_head in the step, else in compute_logits
    }
)
"""Names of the `DecoderOptions` fields the native step runs at any value."""


def unsupported_options(options: Any) -> list[str]:
    """`field=value` for each field of the dataclass `options` that differs from its default
    and is not in `SUPPORTED`, in field order."""
    found = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if field.name not in SUPPORTED and value != _default(field):
            found.append(f"{field.name}={value!r}")
    return found


def refusal(options: Any) -> str | None:
    """Why the native step cannot run a decoder with these options, or None."""
    unsupported = unsupported_options(options)
    if not unsupported:
        return None
    return f"the native step does not implement {', '.join(unsupported)}"


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING  # a field without a default: any value counts as set
