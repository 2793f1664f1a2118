"""EngineConfig: the one flat configuration of an engine. Field names are the CLI flags.

`nanollmserve serve --max-num-seqs 32` and `LLM(max_num_seqs=32)` set the same field; the CLI
builds its engine flags from this dataclass (see `add_engine_args`), so a new field is a new
flag with no other change.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from nanollmserve.errors import UserError
from nanollmserve.pooler_config import PoolerConfig
from nanollmserve.quantization_names import GGUF_METHOD, NO_QUANTIZATION, QUANTIZATION_METHODS
from nanollmserve.sizes import parse_size
from nanollmserve.speculative_config import SpeculativeConfig


@dataclass
class EngineConfig:
    model: str | None = None
    """Model to load: a local HF directory, a *.gguf file, or empty for the bundled model."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens (default: the model's context, capped at 8192)."""
    max_num_seqs: int = 64
    """Most requests running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step; longer prefills are chunked to fit."""
    scheduling_policy: str = "fcfs"
    """fcfs (first come, first served) | priority (by each request's `priority`, lower
    first, then arrival; a request may preempt running ones of a higher value)."""
    priority_aging_steps: int = 1000
    """Under the priority policy, a waiting request's priority improves by one level per N
    engine steps since it arrived, so no request starves behind a flood of urgent ones; 0:
    off (strict priority, as vLLM)."""
    max_client_priority: int | None = None
    """The most urgent (lowest) `priority` a request may ask for; a lower one is a 400 naming
    this limit (default: any int32)."""
    block_size: int = 16
    """Tokens per KV cache block."""
    num_kv_blocks: int | None = None
    """Number of KV cache blocks (overrides --kv-cache-memory)."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache, or a size such as 2GiB or 512MiB (default: 1 GiB on CPU; on CUDA
    what --gpu-memory-utilization leaves after the weights)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's total memory this engine may use (0 < F <= 1); the KV cache gets
    what is left after the weights. CUDA only (on CPU, --kv-cache-memory sizes the cache)."""
    kv_cache_dtype: str = "auto"
    """auto (float16 under a GGUF file's blocks, the CPU default; else the model's dtype) |
    float32 | float16 (a float cache of that type) | int8 | fp8_e4m3 | fp8_e5m2 (fp8 =
    fp8_e4m3): K and V stored as 8-bit codes with a float32 scale per token and KV head, about
    1.9x the tokens of a float16 cache in the same memory (int8 runs the native decode step; fp8
    the PyTorch attention). Each tensor-parallel rank quantizes its own KV heads; the 8-bit
    types not with --kv-offload-dir."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of shared prompt prefixes."""
    kv_offload_dir: str | None = None
    """A directory where full prefix blocks are also written (as they are computed) and read
    back when a later request's prefix misses the KV pool, also after a restart (default:
    off; not with tensor parallelism)."""
    kv_offload_max_bytes: int = 4 << 30
    """Most bytes of blocks --kv-offload-dir keeps, a size such as 8GiB (default: 4GiB); the
    least recently used go first."""
    enable_sleep_mode: bool = False
    """Serve POST /sleep?level=1|2 (free the KV cache; 2: the weights too), POST /wake_up and
    GET /is_sleeping, vLLM's sleep-mode routes, behind --admin-api-key (not with tensor
    parallelism)."""
    seed: int = 0
    """Seed of the sampler for requests that do not set their own."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory to use instead of the model's."""
    quantization: str | None = None
    """CPU weight formats: gguf (a GGUF file's own Q4_0/Q4_1/Q8_0 blocks through our native
    kernels, float32 math; the default for GGUF models on CPU with --dtype auto), int8
    (weight-only int8), fp16 (float16 weights, float32 math), or none (the dequantized weights
    in --dtype)."""
    tensor_parallel_size: int = 1
    """Shard the model over N ranks (Megatron-style: heads, MLP and vocabulary split); rank 0
    spawns the others on this machine (GPUs cuda:0..N-1, or CPU processes with gloo)."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories) on top of the base model."""
    max_loras: int = 1
    """Most LoRA adapters in one batch (preallocated slots)."""
    max_lora_rank: int = 16
    """Highest LoRA rank an adapter may have (the slots' size)."""
    speculative_config: str | dict | SpeculativeConfig | None = None
    """Speculative decoding as JSON, vLLM's keys: {"method": "ngram", "num_speculative_tokens":
    4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or {"method": "draft_model", "model":
    PATH, "num_speculative_tokens": 3} (default: off)."""
    runner: str = "generate"
    """generate (text generation) | pooling (embeddings: /v1/embeddings; each prompt runs
    as a prefill only, its hidden states pooled by --pooler-config, no token sampled)."""
    task: str | None = None
    """vLLM's older spelling of --runner: embed (= --runner pooling) | generate."""
    pooler_config: str | dict | PoolerConfig | None = None
    """How --runner pooling pools, as JSON, vLLM's keys: {"pooling_type": "LAST" | "MEAN" |
    "CLS", "normalize": true} (default: LAST, normalized)."""
    step_record: int = 4096
    """Keep a record of the last N engine steps (the flight recorder: /debug/steps,
    `nanollmserve trace export`, `nanollmserve replay`); 0: off."""
    step_record_max_bytes: int = 64 << 20
    """Most bytes the flight recorder's ring may hold (estimated per step), a size such as
    16MiB (default: 64MiB); past it the oldest steps go, whatever --step-record says."""
    step_record_prompts: bool = False
    """Keep each arrival's prompt token ids and full sampling parameters in the flight
    record (what `nanollmserve replay` needs); off: only prompt lengths and keyed hashes."""

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._resolve_runner()
        for name in BYTE_SIZE_FIELDS:  # LLM(kv_cache_memory="2GiB") reads as the flag does
            if getattr(self, name) is not None:
                try:
                    setattr(self, name, parse_size(getattr(self, name)))
                except ValueError as exc:
                    raise UserError(f"{name}: {exc}") from None
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.quantization not in (None, *QUANTIZATION_METHODS, NO_QUANTIZATION):
            names = " or ".join((*QUANTIZATION_METHODS, NO_QUANTIZATION))
            raise UserError(f"quantization must be {names} (or unset), got {self.quantization!r}")
        if not 0 <= self.step_record <= MAX_STEP_RECORD:
            raise UserError(
                f"step_record must be in [0, {MAX_STEP_RECORD}], got {self.step_record}"
            )
        if not 1 <= self.step_record_max_bytes <= MAX_STEP_RECORD_BYTES:
            raise UserError(
                f"step_record_max_bytes must be in [1, {MAX_STEP_RECORD_BYTES}] bytes (1TiB), "
                f"got {self.step_record_max_bytes}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise UserError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if not _is_int(self.priority_aging_steps) or not (
            0 <= self.priority_aging_steps <= MAX_PRIORITY_AGING_STEPS
        ):
            raise UserError(
                f"priority_aging_steps must be in [0, {MAX_PRIORITY_AGING_STEPS}], "
                f"got {self.priority_aging_steps}"
            )
        limit = self.max_client_priority
        if limit is not None and not (_is_int(limit) and -(2**31) <= limit < 2**31):
            raise UserError(f"max_client_priority must be an int32, got {limit}")
        if self.tensor_parallel_size < 1:
            raise UserError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise UserError("enable_sleep_mode is not supported with tensor parallelism")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        if (
            self.tokenizer is not None
            and not Path(self.tokenizer, "tokenizer_config.json").is_file()
        ):
            raise UserError(
                f"tokenizer must be a Hugging Face tokenizer directory (with "
                f"tokenizer_config.json), got {self.tokenizer!r}"
            )
        if self.max_lora_rank < 1:
            raise UserError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.enable_lora and self.quantization not in (None, NO_QUANTIZATION, GGUF_METHOD):
            raise UserError(
                f"LoRA adapters with --quantization {self.quantization} are not supported "
                "(they run on the GGUF blocks or on unquantized weights)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        self._check_kv_cache_dtype()
        self._check_kv_offload()

    def _check_kv_cache_dtype(self) -> None:
        """A name it knows; what a quantized cache does not run with."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise UserError(
                f"kv_cache_dtype must be {' | '.join(KV_CACHE_DTYPE_NAMES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype in ("auto", "float32", "float16"):
            return
        if self.kv_offload_dir is not None:
            raise UserError(
                f"kv_cache_dtype {self.kv_cache_dtype} is not supported with kv_offload_dir "
                "(the offloaded block format has no scales): use auto, float32 or float16"
            )

    def _check_kv_offload(self) -> None:
        """What --kv-offload-dir needs: the prefix cache it extends, one rank."""
        if self.kv_offload_max_bytes < 1:
            raise UserError(f"kv_offload_max_bytes must be >= 1, got {self.kv_offload_max_bytes}")
        if self.kv_offload_dir is None:
            return
        if not self.enable_prefix_caching or self.runner == "pooling":
            raise UserError(
                "kv_offload_dir extends the prefix cache: it needs prefix caching on "
                "(not --no-enable-prefix-caching, not --runner pooling)"
            )
        if self.tensor_parallel_size > 1:
            raise UserError(
                "kv_offload_dir is not supported with tensor parallelism (each rank holds "
                "a shard of the KV heads)"
            )

    def _resolve_runner(self) -> None:
        """`task` folded into `runner`; the pooler config parsed; what pooling cannot do."""
        if self.task is not None:
            if self.task not in TASK_RUNNERS:
                raise UserError(f"task must be embed or generate, got {self.task!r}")
            if self.runner != "generate" and self.runner != TASK_RUNNERS[self.task]:
                raise UserError(f"task {self.task!r} contradicts runner {self.runner!r}")
            self.runner = TASK_RUNNERS[self.task]
        if self.runner not in RUNNERS:
            raise UserError(f"runner must be generate or pooling, got {self.runner!r}")
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise UserError("pooler_config needs --runner pooling (or --task embed)")
            return
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        if self.speculative_config is not None:
            raise UserError("speculative decoding has nothing to speed up with --runner pooling")


SCHEDULING_POLICIES = ("fcfs", "priority")
KV_CACHE_DTYPE_NAMES = ("auto", "float32", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's names and two float types (`layers/kv_quant.py` maps them to dtypes)."""
MAX_STEP_RECORD = 1 << 20
"""The most steps `step_record` may keep."""
MAX_STEP_RECORD_BYTES = 1 << 40
"""The largest `step_record_max_bytes`."""

MAX_PRIORITY_AGING_STEPS = 2**31 - 1
"""The largest `priority_aging_steps`."""

RUNNERS = ("generate", "pooling")
TASK_RUNNERS = {"embed": "pooling", "generate": "generate"}

# Fields given in bytes: their flags take sizes with a suffix (`--kv-cache-memory 2GiB`).
BYTE_SIZE_FIELDS = ("kv_cache_memory", "kv_offload_max_bytes", "step_record_max_bytes")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add one flag per EngineConfig field. A boolean gets --X and --no-X (vLLM's names); an
    `enable_X` one also keeps the older alias --no-X."""
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else None
        doc = _FIELD_DOCS.get(f.name, "").replace("%", "%%")
        if f.name == "model":
            if model_positional:
                parser.add_argument("model_pos", nargs="?", metavar="MODEL", help=doc)
            parser.add_argument("--model", default=None, help=doc)
        elif f.type == "bool":
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=f"{doc.rstrip('.')} (default: {'on' if default else 'off'})",
            )
            if f.name.startswith("enable_"):
                parser.add_argument(
                    _flag("no_" + f.name.removeprefix("enable_")),
                    dest=f.name,
                    action="store_false",
                    help=f"Same as {_flag('no_' + f.name)}",
                )
        else:
            kind = int if "int" in f.type else float if "float" in f.type else str
            if f.name in BYTE_SIZE_FIELDS:
                kind = parse_size
            parser.add_argument(_flag(f.name), dest=f.name, type=kind, default=default, help=doc)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if getattr(args, "model_pos", None):
        if values.get("model") and values["model"] != args.model_pos:
            raise UserError("give the model once: positional MODEL or --model, not both")
        values["model"] = args.model_pos
    return EngineConfig(**values)


def _field_docs() -> dict[str, str]:
    """Attribute docstrings of EngineConfig, used as the CLI help of each flag."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    body = ast.parse(inspect.getsource(EngineConfig)).body[0].body
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
            docs[node.target.id] = nxt.value.value
    return docs


_FIELD_DOCS = _field_docs()
