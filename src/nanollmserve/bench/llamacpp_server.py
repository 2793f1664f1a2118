"""llama.cpp's native `llama-server` as a subprocess, and greedy token ids from it.

`scripts/peer-llamacpp setup` builds the binary into `.peer/llama.cpp/build/bin/`; this starts
it on a GGUF file (the bundled one by default) with one slot and the same threads flags the
peer script uses, on a free port, and stops it when the `with` block ends (`OwnServer` does
the starting, the `/health` wait and the log).

`greedy_token_ids` asks its native `/completion` endpoint for a completion of a prompt given
as token ids (no chat template or tokenizer of llama.cpp's in the way) at temperature 0 and
reads back the generated token ids (`return_tokens`), so they compare with ours id for id.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from nanollmserve.bench.server_process import OwnServer
from nanollmserve.errors import UserError

DEFAULT_BINARY = Path(".peer/llama.cpp/build/bin/llama-server")


class LlamaCppServer(OwnServer):
    def __init__(self, binary: Path, gguf: Path, threads: int, n_ctx: int = 4096) -> None:
        super().__init__([])
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise UserError(
                f"no llama-server at {binary}: build it with `scripts/peer-llamacpp setup` "
                f"(or pass --llamacpp-bin PATH)"
            )
        self.binary, self.gguf, self.threads, self.n_ctx = binary, gguf, threads, n_ctx

    def command(self) -> list[str]:
        t = str(self.threads)
        return [
            str(self.binary), "-m", str(self.gguf), "-t", t, "-tb", t, "-np", "1",
            "-c", str(self.n_ctx), "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip

    def version(self) -> str:
        """`llama-server --version` (build number and commit), one line."""
        import subprocess

        proc = subprocess.run(
            [str(self.binary), "--version"], capture_output=True, text=True, timeout=60
        )
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return next((line for line in lines if "version" in line), lines[0] if lines else "")


def greedy_token_ids(url: str, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """llama-server's greedy continuation of the prompt ids (stops at its end-of-generation
    tokens, as ours stops at EOS), as token ids."""
    body = {
        "prompt": prompt_token_ids,
        "n_predict": max_tokens,
        "temperature": 0.0,
        "return_tokens": True,
        "cache_prompt": False,
    }
    response = httpx.post(f"{url}/completion", json=body, timeout=600, trust_env=False)
    response.raise_for_status()
    return [int(t) for t in response.json()["tokens"]]
