"""`nanollmserve serve --tensor-parallel-size 2` (m14): a tiny model sharded over two CPU
processes (gloo) answers the openai SDK as one process does and stops cleanly on SIGTERM;
a rank that dies takes the server down with a clear log line instead of hanging; started by
torchrun, the ranks rendezvous through its environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and rank 0 alone serves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from live_server import LiveServer, free_port
from test_model_parity import make_tiny_hf_model
from transformers import AutoTokenizer, LlamaConfig

from nanollmserve import LLM, SamplingParams
from nanollmserve.model import resolve_model

pytestmark = pytest.mark.milestone("m14")

TP_ARGS = ("--tensor-parallel-size", "2", "--num-kv-blocks", "64", "--block-size", "8")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    # The bundled tokenizer's vocabulary, so text prompts and chat work.
    make_tiny_hf_model(LlamaConfig, path, tie_word_embeddings=False, vocab_size=49152)
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(path)
    return path


def worker_pids(server: LiveServer) -> list[int]:
    return [int(pid) for pid in re.findall(r"rank \d+ of 2 \(pid (\d+)\) ready", server.log())]


def is_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or "State:\tZ" in _status(pid):
            return True
        time.sleep(0.1)
    return False


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def test_sharded_server_answers_the_openai_sdk_and_stops_cleanly(tiny_dir: Path) -> None:
    prompt = "The capital of France is"
    with LLM(str(tiny_dir), dtype="float32", block_size=8, num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=8)
        expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    server = LiveServer.start(str(tiny_dir), *TP_ARGS)
    try:
        client = server.openai()
        model = client.models.list().data[0].id
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0.0
        )
        assert completion.choices[0].text == expected
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=0.0,
            stream=True,
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        (pid,) = worker_pids(server)
    finally:
        status = server.stop(signal.SIGTERM)
    assert status == 0, server.log()
    assert is_gone(pid), f"rank 1 (pid {pid}) outlived the server"


def test_a_rank_that_dies_takes_the_server_down(tiny_dir: Path) -> None:
    server = LiveServer.start(str(tiny_dir), *TP_ARGS)
    try:
        (pid,) = worker_pids(server)
        os.kill(pid, signal.SIGKILL)
        status = server.process.wait(timeout=60)
    finally:
        server.stop(signal.SIGKILL)
    log = server.log()
    assert status == 1, log
    assert f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in log


def test_torchrun_ranks_rendezvous_through_the_environment(tiny_dir: Path) -> None:
    prompt = [5, 6, 7, 8, 9]
    with LLM(str(tiny_dir), dtype="float32", block_size=8, num_kv_blocks=64) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=6)
        expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    port = free_port()
    log_fd, log_path = tempfile.mkstemp(prefix="nanollmserve-torchrun-", suffix=".log")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), "-m", "nanollmserve.cli.main", "serve"]
    command += [str(tiny_dir), "--dtype", "float32", "--port", str(port), *TP_ARGS]
    process = subprocess.Popen(command, stdout=log_fd, stderr=subprocess.STDOUT)
    os.close(log_fd)
    server = LiveServer(process, port, Path(log_path), api_key=None)
    try:
        server.wait_ready()
        assert "tensor parallel: 2 ranks (env://)" in server.log()
        client = server.openai()
        completion = client.completions.create(
            model=tiny_dir.name, prompt=prompt, max_tokens=6, temperature=0.0
        )
        assert completion.choices[0].text == expected
    finally:
        server.stop(signal.SIGTERM)
        Path(log_path).unlink(missing_ok=True)
