"""Setting to -inf the logits of the tokens a grammar disallows, from XGrammar's packed token
bitmask (`[rows, ceil(vocab / 32)]` int32; bit j of word w set = token 32 * w + j allowed).

`apply_token_bitmask(logits, bitmask, rows)` masks the given rows in place. On a GPU (or for
logits that are not float32) it calls XGrammar's kernel. On the CPU, XGrammar's kernel visits
every logit of a row with a branch per token, ~240 us per row over a 49,152-token vocabulary
on the development EPYC whatever the mask, which made it the largest part of a constrained
step's overhead. Here, with numpy, only the logits that must change are touched, chosen per
row by counting the allowed tokens (a popcount over the row's words):

- few allowed (between JSON values: a handful of tokens): keep the allowed logits, fill the
  row with -inf, put them back;
- most allowed (inside a string: all but a few hundred tokens): write -inf at the disallowed
  tokens only.

Token ids come from the words that have a bit to act on (`flatnonzero` over the words, then
only those words' bits unpacked), so a row costs one pass over its ~1,500 words plus the
tokens touched. The result is the same as XGrammar's kernel (tests/test_token_bitmask.py).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

_BYTE_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Mask `logits[rows]` in place: every token whose bit in `bitmask[row]` is 0 gets -inf.
    `bitmask` lives on the CPU, with at least `max(rows) + 1` rows and ceil(vocab / 32) words
    (vocab = `logits.shape[1]`); other rows are untouched."""
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and sys.byteorder == "little":
        _apply_numpy(logits.detach().numpy(), bitmask.numpy(), rows)
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[1], indices=rows
    )


def _apply_numpy(logits: np.ndarray, bitmask: np.ndarray, rows: list[int]) -> None:
    vocab = logits.shape[1]
    row_ids = np.asarray(rows, dtype=np.intp)
    words = bitmask[row_ids]
    few_allowed = _popcount(words) * 2 < vocab
    # Per row, the bits of the tokens to act on: the allowed ones where few are allowed,
    # else the disallowed ones.
    picked = np.where(few_allowed[:, None], words, ~words)
    nonzero_words = np.flatnonzero(picked)
    bits = np.unpackbits(picked.reshape(-1)[nonzero_words].view(np.uint8), bitorder="little")
    set_bits = np.flatnonzero(bits)
    which_row, which_word = np.divmod(nonzero_words[set_bits >> 5], picked.shape[1])
    tokens = which_word * 32 + (set_bits & 31)
    in_vocab = tokens < vocab  # the last word's padding bits
    tokens, which_row = tokens[in_vocab], which_row[in_vocab]
    token_rows = row_ids[which_row]
    of_sparse_row = few_allowed[which_row]
    if few_allowed.any():
        kept_rows, kept_tokens = token_rows[of_sparse_row], tokens[of_sparse_row]
        kept = logits[kept_rows, kept_tokens]
        logits[row_ids[few_allowed]] = -np.inf
        logits[kept_rows, kept_tokens] = kept
    if not few_allowed.all():
        of_dense_row = ~of_sparse_row
        logits[token_rows[of_dense_row], tokens[of_dense_row]] = -np.inf


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits per row of int32 words."""
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0; it counts |x| for signed ints
        return np.bitwise_count(words.view(np.uint32)).sum(axis=1, dtype=np.int64)
    return _BYTE_POPCOUNT[words.view(np.uint8)].sum(axis=1, dtype=np.int64)
