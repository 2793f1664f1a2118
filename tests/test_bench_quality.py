"""`bench quality`: perplexity and KL through the engine's forward equal the textbook formulas
computed independently (transformers' logits, torch cross_entropy / kl_div), and the command
prints the JSON it promises."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_model_parity import TINY, make_tiny_hf_model
from transformers import AutoTokenizer, LlamaConfig

from nanollmserve.bench import perplexity
from nanollmserve.bench.greedy_agreement import strip_end, tokens_before_divergence
from nanollmserve.model import ModelConfig, load_model, resolve_model

pytestmark = pytest.mark.milestone("m17")

NUM_TOKENS = 40


def engine_model(model_dir: Path):
    config = ModelConfig.from_pretrained(model_dir)
    return load_model(model_dir, config, torch.float32, torch.device("cpu")).eval()


def test_sliding_windows_score_every_token_after_the_first_once():
    windows = perplexity.sliding_windows(NUM_TOKENS, window=16, stride=8)
    # Written out by hand: each window scores what the previous one did not.
    assert [(w.start, w.end, w.score_from) for w in windows] == [
        (0, 16, 1),
        (8, 24, 16),
        (16, 32, 24),
        (24, 40, 32),
    ]
    assert perplexity.sliding_windows(10, window=16, stride=8) == [perplexity.Window(0, 10, 1)]
    with pytest.raises(ValueError):
        perplexity.sliding_windows(10, window=8, stride=9)


def test_llamacpp_chunks_score_the_second_half_of_each_chunk_as_llama_perplexity_does():
    """llama-perplexity -c 16 over 40 tokens: two chunks (the tail of 8 is dropped), each
    scoring its logits at positions 8..14, i.e. targets 9..15 of the chunk."""
    windows = perplexity.llamacpp_chunks(NUM_TOKENS, window=16)
    assert [(w.start, w.end, w.score_from) for w in windows] == [(0, 16, 9), (16, 32, 25)]
    assert windows[0].rows == (8, 15)
    with pytest.raises(ValueError):
        perplexity.llamacpp_chunks(10, window=16)


def test_perplexity_and_kl_match_cross_entropy_on_transformers_logits(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(perplexity, "ROW_CHUNK", 5)  # several logits chunks per window
    hf_a = make_tiny_hf_model(LlamaConfig, tmp_path / "a", seed=0)
    hf_b = make_tiny_hf_model(LlamaConfig, tmp_path / "b", seed=1)
    ours = {
        "a": perplexity.engine_scorer(engine_model(tmp_path / "a"), torch.device("cpu")),
        "b": perplexity.engine_scorer(engine_model(tmp_path / "b"), torch.device("cpu")),
    }
    ids = torch.randint(
        0, TINY["vocab_size"], (NUM_TOKENS,), generator=torch.Generator().manual_seed(5)
    )
    windows = perplexity.sliding_windows(NUM_TOKENS, window=16, stride=8)
    totals = perplexity.score(ours, ids.tolist(), windows, reference="a")

    # Independently: transformers' logits of each window, the same hand-written windows.
    nll = {"a": 0.0, "b": 0.0}
    kl = 0.0
    with torch.no_grad():
        for start, end, score_from in [(0, 16, 1), (8, 24, 16), (16, 32, 24), (24, 40, 32)]:
            rows = slice(score_from - 1 - start, end - 1 - start)
            targets = ids[score_from:end]
            logits = {
                name: model(ids[None, start:end]).logits[0, rows]
                for name, model in (("a", hf_a), ("b", hf_b))
            }
            for name in nll:
                nll[name] += F.cross_entropy(logits[name], targets, reduction="sum").item()
            log_p, log_q = logits["a"].log_softmax(-1), logits["b"].log_softmax(-1)
            kl += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
    scored = NUM_TOKENS - 1
    for name in nll:
        assert totals[name].num_tokens == scored
        assert totals[name].perplexity == pytest.approx(math.exp(nll[name] / scored), rel=1e-4)
    assert totals["a"].perplexity != pytest.approx(totals["b"].perplexity, rel=1e-3)
    assert totals["a"].mean_kl == pytest.approx(0.0, abs=1e-6)
    assert totals["a"].top1_agreement == 1.0
    assert kl / scored > 0.01  # two different random models: far apart
    assert totals["b"].mean_kl == pytest.approx(kl / scored, rel=1e-4)

    # transformers' model as a scorer gives the same numbers.
    hf_totals = perplexity.score(
        {"a": perplexity.hf_scorer(hf_a)}, ids.tolist(), windows, reference="a"
    )
    assert hf_totals["a"].perplexity == pytest.approx(totals["a"].perplexity, rel=1e-4)


def test_greedy_agreement_counts_the_common_prefix():
    assert tokens_before_divergence([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert tokens_before_divergence([1, 2], [1, 2, 3]) == 2
    assert tokens_before_divergence([7], [8]) == 0
    assert strip_end([5, 6, 2], {2}) == [5, 6]
    assert strip_end([5, 6], {2}) == [5, 6]


def test_bench_quality_cli_prints_json_for_each_config(tmp_path: Path):
    """A tiny random model with the bundled tokenizer, three configs, the text's first 200
    tokens: the command's JSON (stdout and --output) has one row per config."""
    model_dir = tmp_path / "tiny"
    make_tiny_hf_model(LlamaConfig, model_dir, vocab_size=49152)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(model_dir)
    out_file = tmp_path / "quality.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "nanollmserve.cli.main", "bench", "quality",
            "--model", str(model_dir), "--configs", "int8,bf16", "--max-tokens", "200",
            "--window", "64", "--stride", "32", "--output", str(out_file),
        ],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out_file.read_text()) == result
    assert result["benchmark"] == "quality"
    assert result["text"]["path"] == "public_domain_en.txt"
    assert result["text"]["num_tokens"] == 200
    configs = result["configs"]
    assert list(configs) == ["fp32", "int8", "bf16"]  # the reference always first
    assert configs["fp32"]["perplexity_rel_diff_vs_fp32"] == 0.0
    assert configs["fp32"]["kl_vs_fp32"] == pytest.approx(0.0, abs=1e-6)
    assert configs["bf16"]["dtype"] == "bfloat16"
    assert configs["int8"]["quantization"] == "int8"
    for row in configs.values():
        assert row["tokens_scored"] == 199
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
        assert math.exp(row["mean_nll"]) == pytest.approx(row["perplexity"], rel=1e-3)
    # Rounded weights change the distribution a little, never by nothing.
    assert configs["int8"]["kl_vs_fp32"] > 0 and configs["bf16"]["kl_vs_fp32"] > 0


@pytest.mark.timeout(120)
def test_the_cached_scorer_reads_its_kv_back_from_a_pool_of_the_named_type(
    tmp_path: Path, monkeypatch
):
    """`cached_engine_scorer` runs a window in chunks over a paged pool: through float32 K/V
    its hidden states are the whole-window forward's; float16 and int8 K/V move them by their
    rounding (a scorer that ignored the type would give float32's numbers), and the pool is
    released after the window."""
    monkeypatch.setattr(perplexity, "CACHE_CHUNK", 8)  # several chunks per window
    make_tiny_hf_model(LlamaConfig, tmp_path / "m", seed=0)
    model, cpu = engine_model(tmp_path / "m"), torch.device("cpu")
    ids = torch.randint(0, TINY["vocab_size"], (30,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = perplexity.engine_scorer(model, cpu).hidden(ids, 0, 30)
        cached = {
            name: perplexity.cached_engine_scorer(model, cpu, name, torch.float32).hidden(
                ids, 0, 30
            )
            for name in ("float32", "float16", "int8")
        }
    error = {name: float((h - whole).norm() / whole.norm()) for name, h in cached.items()}
    # measured: 3e-7, 5.5e-4, 1.4e-2
    assert error["float32"] < 1e-5, error
    assert 0 < error["float16"] < 1e-2 and 0 < error["int8"] < 1e-1, error
    assert error["int8"] > error["float16"]
    assert all(m.k_cache.numel() == 0 for m in model.modules() if hasattr(m, "k_cache"))
