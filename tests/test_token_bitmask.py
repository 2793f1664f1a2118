"""The CPU token-bitmask application (`engine/token_bitmask.py`) masks exactly the disallowed
tokens: rows with few, half or most tokens allowed, none or all allowed, a vocabulary that is
not a multiple of 32 (padding bits set or not), a subset of the rows; and on real masks from
a JSON schema walked on the bundled tokenizer it gives XGrammar's kernel's result. (The
synthetic cases are checked against the mask itself, not XGrammar: XGrammar 0.2.9's CPU
kernel, for a vocabulary that is not a multiple of 32, writes -inf past the end of a row for
clear padding bits, into the next row's first logits.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import xgrammar

from nanollmserve.engine.token_bitmask import apply_token_bitmask

pytestmark = pytest.mark.milestone("m15")


def _packed(allowed: np.ndarray) -> torch.Tensor:
    """[rows, vocab] bool -> XGrammar's [rows, ceil(vocab / 32)] int32 bitmask."""
    width = (allowed.shape[1] + 31) // 32
    padded = np.zeros((allowed.shape[0], width * 32), dtype=np.uint8)
    padded[:, : allowed.shape[1]] = allowed
    words = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    return torch.from_numpy(words.copy())


def _check_masked(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], allowed):
    """Rows in `rows` keep exactly their allowed logits; the others are unchanged."""
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    expected = logits.clone()
    for row in rows:
        expected[row][~torch.from_numpy(allowed[row])] = float("-inf")
    assert torch.equal(got, expected)
    return got


def _check_same_as_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]):
    expected = logits.clone()
    xgrammar.apply_token_bitmask_inplace(
        expected, bitmask, vocab_size=logits.shape[1], indices=rows
    )
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    return got


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
def test_matches_xgrammar_for_every_density(vocab):
    rng = np.random.default_rng(vocab)
    densities = [0.0, 0.0005, 0.01, 0.3, 0.5, 0.7, 0.99, 0.9995, 1.0]
    allowed = np.stack([rng.random(vocab) < d for d in densities])
    bitmask = _packed(allowed)
    logits = torch.randn(len(densities), vocab)
    rows = list(range(len(densities)))
    got = _check_masked(logits, bitmask, rows, allowed)
    assert torch.equal(torch.isfinite(got), torch.from_numpy(allowed))


def test_padding_bits_past_the_vocabulary_are_ignored():
    vocab = 1000  # 32 words: the last has 8 bits past the vocabulary
    allowed = np.zeros((2, vocab), dtype=bool)
    allowed[0, 5] = True
    allowed[1, :] = True
    bitmask = _packed(allowed)
    bitmask[:, -1] |= torch.tensor(-(1 << 8), dtype=torch.int32)  # bits 1000..1023 set
    _check_masked(torch.randn(2, vocab), bitmask, [0, 1], allowed)
    bitmask = _packed(allowed)  # and padding bits clear
    _check_masked(torch.randn(2, vocab), bitmask, [0, 1], allowed)


def test_only_the_given_rows_change():
    rng = np.random.default_rng(1)
    vocab = 4096
    allowed = rng.random((6, vocab)) < np.array([[0.001], [0.9], [0.5], [0.0], [1.0], [0.1]])
    bitmask = _packed(allowed)
    logits = torch.randn(6, vocab)
    rows = [1, 3, 5]
    got = _check_masked(logits, bitmask, rows, allowed)
    for row in (0, 2, 4):
        assert torch.equal(got[row], logits[row])
    assert not torch.isfinite(got[3]).any()


def test_real_json_schema_masks_on_the_bundled_tokenizer():
    from nanollmserve.bench.grammar_mask import DEFAULT_SCHEMA
    from nanollmserve.engine.grammar_compiler import GrammarCompiler
    from nanollmserve.frontend.tokenizer import load_tokenizer
    from nanollmserve.model.model_config import ModelConfig
    from nanollmserve.model.source import resolve_model
    from nanollmserve.structured_outputs import StructuredOutputsParams

    source = resolve_model(None)
    config = ModelConfig.from_pretrained(source.path)
    compiler = GrammarCompiler(
        load_tokenizer(source.path), config.vocab_size, sorted(config.eos_token_ids)
    )
    compiled = compiler.compile(StructuredOutputsParams(json=DEFAULT_SCHEMA))
    batch = 4
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgrammar.allocate_token_bitmask(batch, config.vocab_size)
    rng = random.Random(0)
    few = many = 0
    for _ in range(40):
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)
        logits = torch.randn(batch, config.vocab_size)
        got = _check_same_as_xgrammar(logits, bitmask, list(range(batch)))
        for i, matcher in enumerate(matchers):
            allowed = torch.isfinite(got[i]).nonzero().flatten().tolist()
            few += len(allowed) * 2 < config.vocab_size
            many += len(allowed) * 2 >= config.vocab_size
            assert matcher.accept_token(rng.choice(allowed))
            if matcher.is_terminated():
                matchers[i] = xgrammar.GrammarMatcher(compiled)
    assert few and many  # both ways of masking were exercised
