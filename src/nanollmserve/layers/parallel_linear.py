"""Megatron-style tensor-parallel layers: column- and row-parallel linears, a vocab-parallel
embedding and LM head. With a group of one they are plain `nn.Linear` / `nn.Embedding`.

- Column-parallel (`qkv_proj`, `gate_up_proj`, the LM head): the weight is split by output
  rows, each rank computes its slice of the outputs, no communication. A fused layer is
  split part by part (q, k, v; gate, up), so rank r holds `[q_r | k_r | v_r]` and the fused
  layout the model slices stays right on every rank.
- Row-parallel (`o_proj`, `down_proj`): the weight is split by input columns, each rank
  multiplies its slice of the inputs (the column-parallel output it already holds) and an
  all-reduce sums the partial outputs; the bias is added once, after the sum.
- Vocab-parallel embedding: rank r holds rows `[r * n, (r + 1) * n)` of the table; a token
  outside them looks up zeros, and an all-reduce (one non-zero term per token, so exact)
  gives every rank the full embedding. The LM head (or the tied table) gives each rank its
  slice of the logits, gathered along the vocabulary. A vocabulary that does not divide is
  padded with zero rows on the last rank and the padding is cut off the gathered logits.

Each layer's `shard_weight(tensor, part)` cuts this rank's slice out of a checkpoint tensor
(`part`: the index of a fused part, as in the model's `packed_modules_mapping`); the loader
calls it through `shard_checkpoint_tensor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanollmserve.distributed.parallel_state import (
    all_gather_last_dim,
    all_reduce,
    get_tp_rank,
    get_tp_size,
)


class ColumnParallelLinear(nn.Linear):
    """[..., input_size] -> [..., sum(output_sizes) / tp]: this rank's slice of each part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.part_sizes = [size // self.tp_size for size in output_sizes]
        """Rows of each fused part on this rank."""
        super().__init__(input_size, sum(self.part_sizes), bias=bias)

    def shard_weight(self, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        """Rows of part `part` (the whole layer when None) that this rank holds."""
        size = self.part_sizes[part or 0]
        return tensor.narrow(0, self.part_start(part or 0), size)

    def part_start(self, part: int) -> int:
        return self.tp_rank * self.part_sizes[part]


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, split by heads. With fewer KV heads than ranks each KV head
    is replicated on `tp / num_kv_heads` ranks: rank r holds KV head `r * num_kv_heads // tp`,
    the one its query heads use."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_kv_heads_total = num_kv_heads
        kv_per_rank = max(1, num_kv_heads // tp)
        q, kv = num_heads * head_dim, kv_per_rank * head_dim * tp
        super().__init__(hidden_size, [q, kv, kv], bias)

    def part_start(self, part: int) -> int:
        if part == 0:
            return super().part_start(0)
        first_kv_head = self.tp_rank * self.num_kv_heads_total // self.tp_size
        return first_kv_head * self.head_dim


class RowParallelLinear(nn.Linear):
    """[..., input_size / tp] -> [..., output_size], summed over the ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size // self.tp_size, output_size, bias=bias)

    def shard_weight(self, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        if tensor.dim() == 1:  # the bias: whole on every rank, added after the sum
            return tensor
        size = self.in_features
        return tensor.narrow(1, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(x)
        out = all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def vocab_rows_per_rank(vocab_size: int) -> int:
    return -(-vocab_size // get_tp_size())


def _shard_vocab_rows(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] table, zero-padded to `vocab_rows_per_rank`."""
    rows = vocab_rows_per_rank(vocab_size)
    start = get_tp_rank() * rows
    shard = tensor[start : start + rows]
    if shard.shape[0] < rows:
        padding = tensor.new_zeros(rows - shard.shape[0], *tensor.shape[1:])
        shard = torch.cat([shard, padding])
    return shard


class VocabParallelEmbedding(nn.Embedding):
    """Token ids -> embeddings, the table split by vocabulary rows over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tp_size = get_tp_size()
        self.vocab_size = vocab_size
        rows = vocab_rows_per_rank(vocab_size)
        self.vocab_start = get_tp_rank() * rows
        super().__init__(rows, hidden_size)

    def reset_parameters(self) -> None:
        # Built on the meta device for loading, the table has nothing to fill, and filling a
        # meta tensor with random numbers imports torch._dynamo (0.5 s of every start).
        if not self.weight.is_meta:
            super().reset_parameters()

    def shard_weight(self, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        return _shard_vocab_rows(tensor, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return all_reduce(out.masked_fill_(~mine[:, None], 0.0))


class ParallelLMHead(nn.Linear):
    """hidden -> this rank's slice of the logits (`gather_logits` puts them together)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        super().__init__(hidden_size, vocab_rows_per_rank(vocab_size), bias=False)

    def shard_weight(self, tensor: torch.Tensor, part: int | None) -> torch.Tensor:
        return _shard_vocab_rows(tensor, self.vocab_size)


def gather_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each rank's [N, vocab / tp] logits -> the full [N, vocab] on every rank."""
    return all_gather_last_dim(local_logits)[:, :vocab_size]


def shard_checkpoint_tensor(
    model: nn.Module, name: str, part: int | None, tensor: torch.Tensor
) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `name` (our parameter name; `part` of a fused
    one), a copy so the full tensor can be freed; the tensor itself with a group of one or
    for a replicated parameter (norms)."""
    if get_tp_size() == 1:
        return tensor
    module_name, _, _ = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return tensor  # reported as unexpected by the loader
    shard = getattr(module, "shard_weight", None)
    return tensor if shard is None else shard(tensor, part).clone()
