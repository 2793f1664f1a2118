"""The Llama decoder (Llama 2/3.x, SmolLM2, TinyLlama, Mistral), nano-vllm style.

The forward runs over one flat batch of tokens from many sequences, no batch dimension and no
padding: `model(input_ids [T], positions [T]) -> hidden [T, hidden_size]`. How those tokens
split into sequences and where their K/V live is the attention context the model runner sets
before each step (`nanollmserve.layers.attention_context`); `compute_logits` turns the hidden
states of the tokens the runner samples into float32 logits.

q/k/v are one matmul (`qkv_proj`) and so are gate/up (`gate_up_proj`); the loader packs the HF
tensors into them (`packed_modules_mapping`). Every option that changes the math is a field of
`DecoderOptions` (`decoder_options.py`), read from the config by `decoder_options`; Qwen2 and
Qwen3 (`qwen.py`) and Gemma 3 (`gemma.py`) are this decoder with other options.

Under tensor parallelism (`layers/parallel_linear.py`) each rank builds this same model with
its share of the heads, the MLP width and the vocabulary; with a group of one the parallel
layers are plain linears and embeddings.

The native step (`engine/native_decode.py`) runs this same decoder in C. It is built from
`LlamaForCausalLM.native_decoder()`, the model's declaration of its sizes, options and
tensors (`model/native_decoder.py`), which says why when the model cannot be declared
(projections not in GGUF blocks, tensor parallelism); the native step refuses the options it
does not implement (`native/supported.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve.distributed.parallel_state import get_tp_size
from nanollmserve.layers.activation import ACTIVATIONS
from nanollmserve.layers.attention import PagedAttention
from nanollmserve.layers.gguf_embedding import GGUFEmbedding
from nanollmserve.layers.gguf_linear import GGUFLinear
from nanollmserve.layers.norm import RMSNorm
from nanollmserve.layers.parallel_linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_logits,
)
from nanollmserve.layers.rotary import RotaryEmbedding, apply_rotary
from nanollmserve.model.decoder_options import DecoderOptions
from nanollmserve.model.model_config import ModelConfig
from nanollmserve.model.native_decoder import NativeDecoder, NativeLayer, NotNativeError


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions, layer: int = 0):
        super().__init__()
        tp_size = get_tp_size()  # this rank's share of the heads; KV heads replicated if few
        self.num_heads = config.num_heads // tp_size
        self.num_kv_heads = max(1, config.num_kv_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=options.qkv_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * self.head_dim, config.hidden_size, bias=options.o_bias
        )
        if options.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, options.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, options.norm_offset)
        self.qk_norm = options.qk_norm
        scalar = options.query_pre_attn_scalar or self.head_dim
        window = options.sliding_window if options.is_sliding(layer) else None
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, scale=scalar**-0.5,
            sliding_window=window,
        )  # fmt: skip

    def forward(
        self, rope: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor
    ) -> torch.Tensor:
        """rope: this step's (cos, sin) rows from `RotaryEmbedding.cos_sin`."""
        qkv = self.qkv_proj(hidden)
        num_tokens = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(num_tokens, self.num_kv_heads, self.head_dim))
            qk = torch.cat([q, k], dim=1)
        else:  # q and k are adjacent in the fused output: rotate both in one call
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        q, k = apply_rotary(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions):
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, options.mlp_bias
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], bias=bias)
        self.act_fn = ACTIVATIONS[options.activation]()
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions, layer: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, options, layer)
        self.mlp = LlamaMLP(config, options)
        hidden, eps, offset = config.hidden_size, config.rms_norm_eps, options.norm_offset
        self.input_layernorm = RMSNorm(hidden, eps, offset)
        # With sandwich norms this one normalizes the attention output alone (Gemma); else it
        # is the norm before the MLP, the residual added in.
        self.post_attention_layernorm = RMSNorm(hidden, eps, offset)
        self.sandwich_norms = options.sandwich_norms
        if options.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, offset)
        self.sliding = options.is_sliding(layer)
        """Whether this layer reads the local RoPE table (`LlamaModel.rotary_emb_local`)."""

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP output and the residual stream before it; the next norm adds them."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden)
        if self.sandwich_norms:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, options: DecoderOptions):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, options.rope_scaling
        )
        # The sliding layers' own table (Gemma 3: another base, no scaling), or None.
        self.rotary_emb_local = (
            None
            if options.local_rope_theta is None
            else RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, options.local_rope_theta, None
            )
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, options, i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, options.norm_offset)
        self.embed_scale = options.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale != 1.0:  # HF casts the scale to the model dtype first
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        rope = self.rotary_emb.cos_sin(positions)  # once per step, shared by every layer
        local = rope if self.rotary_emb_local is None else self.rotary_emb_local.cos_sin(positions)
        for layer in self.layers:
            hidden, residual = layer(local if layer.sliding else rope, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    """HF module name -> (our fused module, shard index): the loader concatenates the shards."""

    def __init__(self, config: ModelConfig, options: DecoderOptions | None = None):
        """`options`: the architecture's own (`decoder_options(config)`) when None."""
        super().__init__()
        self.config = config
        self.options = self.decoder_options(config) if options is None else options
        self.model = LlamaModel(config, self.options)
        # Tied embeddings: the output projection is embed_tokens.weight, no parameter of its own.
        self.lm_head = (
            None
            if self.options.tie_word_embeddings
            else ParallelLMHead(config.hidden_size, config.vocab_size)
        )

    @classmethod
    def decoder_options(cls, config: ModelConfig) -> DecoderOptions:
        """The options of this architecture with this config."""
        return DecoderOptions(
            qkv_bias=config.attention_bias,
            o_bias=config.attention_bias,
            mlp_bias=config.mlp_bias,
            tie_word_embeddings=config.tie_word_embeddings,
            rope_scaling=config.rope_scaling,
            activation=config.hidden_act,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (on every rank)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        logits = gather_logits(logits, self.config.vocab_size).float()
        cap = self.options.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def native_decoder(self) -> NativeDecoder:
        """This model as the native decode step runs it (`model/native_decoder.py`), or
        NotNativeError with the reason it cannot (checked in order, the first one named)."""
        config, decoder = self.config, self.model
        if get_tp_size() != 1:
            raise NotNativeError("the model is sharded over a tensor-parallel group")
        embedding = decoder.embed_tokens
        quantized_embed = isinstance(embedding, GGUFEmbedding)
        embed = embedding.tiles if quantized_embed else embedding.weight
        if embed.device.type != "cpu" or not (quantized_embed or embed.dtype == torch.float32):
            raise NotNativeError(
                f"the weights are {embed.dtype} on {embed.device}, not float32 on the CPU"
            )

        def folded(norm: RMSNorm) -> torch.Tensor:
            """The norm's scale as the step multiplies by it: `offset + weight` folded into a
            tensor of its own when the norm has an offset (Gemma's 1 + w), else the weight."""
            return norm.weight + norm.offset if norm.offset else norm.weight

        layers = []
        for i, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(p, GGUFLinear) for p in projections):
                names = [type(p).__name__ for p in projections]
                raise NotNativeError(
                    f"layer {i}'s projections are {names}, not all GGUF blocks (GGUFLinear)"
                )
            sandwich, sliding = layer.sandwich_norms, layer.sliding
            local_rope = decoder.rotary_emb_local if sliding else None
            layers.append(
                NativeLayer(
                    *projections,
                    input_norm=folded(layer.input_layernorm),
                    # with sandwich norms `post_attention_layernorm` is the attention output's
                    post_norm=folded(
                        layer.pre_feedforward_layernorm
                        if sandwich
                        else layer.post_attention_layernorm
                    ),
                    q_norm=folded(attn.q_norm) if attn.qk_norm else None,
                    k_norm=folded(attn.k_norm) if attn.qk_norm else None,
                    k_cache=attn.attn.k_cache,
                    v_cache=attn.attn.v_cache,
                    k_scale=attn.attn.k_scale,
                    v_scale=attn.attn.v_scale,
                    attn_out_norm=folded(layer.post_attention_layernorm) if sandwich else None,
                    mlp_out_norm=folded(layer.post_feedforward_layernorm) if sandwich else None,
                    rope=None if local_rope is None else local_rope.cos_sin_cache,
                    window=attn.attn.sliding_window or 0,
                )
            )
        attention = decoder.layers[0].self_attn
        return NativeDecoder(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=attention.num_heads,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            attn_scale=attention.attn.scale,
            embed=embed,
            embed_kind=embedding.kind if quantized_embed else 0,
            final_norm=folded(decoder.norm),
            rope=decoder.rotary_emb.cos_sin_cache,
            lm_head=self.lm_head if isinstance(self.lm_head, GGUFLinear) else None,
            layers=tuple(layers),
            options=self.options,
        )

    def attention_layers(self) -> list[PagedAttention]:
        """Each layer's PagedAttention, in layer order: the runner binds `k_cache`/`v_cache`."""
        return [layer.self_attn.attn for layer in self.model.layers]
