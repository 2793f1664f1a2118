"""The feature x feature compatibility matrix and the generator of its page
(docs/features/compatibility.md).

Every pair of FEATURES has one cell in CELLS, and every cell carries its evidence:
`works(test ids)`: a test runs the two features together; `refused(error, test ids)`: the
pair is refused with that error and a test checks it; `not_run(reason)`: only for CUDA, which
no machine of this project has, so nothing about it is claimed as tested.

Usage (standard library only):
  python scripts/compat_matrix.py            write docs/features/compatibility.md
  python scripts/compat_matrix.py --check    exit 1 when a cell lacks evidence, a named test
                                             function is missing or the page is out of date
                                             (scripts/check_docs.py runs this check)
  python scripts/compat_matrix.py --collect  --check, and every named test id must be
                                             collected by pytest (`make check` runs this)
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

PAGE = "docs/features/compatibility.md"

FEATURES = {
    "tp": "Tensor parallelism",
    "gguf": "GGUF blocks",
    "int8": "int8",
    "lora": "LoRA",
    "spec": "Speculative decoding",
    "structured": "Structured output",
    "grpc": "gRPC",
    "router": "Router",
    "cuda": "CUDA",
}
NOT_RUN_ALLOWED = {"cuda"}  # the only feature no machine here can run


@dataclass(frozen=True)
class Cell:
    state: str  # "works" | "refused" | "not run"
    tests: tuple[str, ...] = ()
    error: str = ""
    note: str = ""


def works(*tests: str, note: str = "") -> Cell:
    return Cell("works", tests, note=note)


def refused(error: str, *tests: str, note: str = "") -> Cell:
    return Cell("refused", tests, error=error, note=note)


def not_run(note: str) -> Cell:
    return Cell("not run", note=note)


TP = "tests/test_compat_tensor_parallel.py::"
QUANT = "tests/test_compat_quantized.py::"
LORA = "tests/test_compat_lora.py::"
REFUSALS = "tests/test_compat_refusals.py::"
NO_GPU = "not run: no GPU here."
CPU_ONLY = "The engine refuses it (`--quantization {} runs on the CPU only`); " + NO_GPU
TP_REFUSED = TP + "test_unsupported_features_are_refused_before_ranks_start[{}]"
Q_SPEC = QUANT + "test_speculation_runs_on_the_quantized_weights[{}]"
Q_GRPC = QUANT + "test_structured_output_over_grpc_on_the_quantized_weights[{}]"
Q_ROUTER = QUANT + "test_router_in_front_of_the_quantized_worker_keeps_the_schema[{}]"

CELLS: dict[tuple[str, str], Cell] = {
    ("tp", "gguf"): refused(
        "tensor parallelism with --quantization is not supported yet",
        TP_REFUSED.format("quantization"),
        note="Without `--quantization`, a GGUF model is sharded as dequantized weights.",
    ),
    ("tp", "int8"): refused(
        "tensor parallelism with --quantization is not supported yet",
        "tests/test_tensor_parallel.py::test_quantization_with_tensor_parallelism_is_rejected",
    ),
    ("tp", "lora"): refused(
        "tensor parallelism with LoRA adapters is not supported yet", TP_REFUSED.format("lora")
    ),
    ("tp", "spec"): refused(
        "tensor parallelism with speculative decoding is not supported yet",
        TP_REFUSED.format("speculation"),
    ),
    ("tp", "structured"): works(
        TP + "test_sharded_worker_constrains_output_over_grpc",
        TP + "test_router_in_front_of_a_sharded_worker_keeps_the_choice",
    ),
    ("tp", "grpc"): works(TP + "test_sharded_worker_constrains_output_over_grpc"),
    ("tp", "router"): works(TP + "test_router_in_front_of_a_sharded_worker_keeps_the_choice"),
    ("tp", "cuda"): not_run(
        "The GPU count is checked before any rank starts "
        "(tests/test_tensor_parallel.py::test_more_ranks_than_gpus_is_a_clear_error); "
        "the NCCL run itself is " + NO_GPU
    ),
    ("gguf", "int8"): refused(
        "quantization must be int8 or fp16 or gguf or none (or unset)",
        "tests/test_quantization.py::test_cli_rejects_an_unknown_quantization_in_one_line",
        note="Alternatives, not a pair: `--quantization` takes one method.",
    ),
    ("gguf", "lora"): works(
        "tests/test_lora.py::test_adapter_on_the_gguf_blocks_matches_peft_merged_model",
        note="The adapter's delta is added in float32 beside each block matmul.",
    ),
    ("gguf", "spec"): works(
        Q_SPEC.format("gguf"),
        note="Verify steps run as one native call: copy 1.25x, greedy random text 1.73x "
        "the speed without speculation (docs/features/speculative-decoding.md).",
    ),
    ("gguf", "structured"): works(Q_GRPC.format("gguf"), Q_ROUTER.format("gguf")),
    ("gguf", "grpc"): works(Q_GRPC.format("gguf")),
    ("gguf", "router"): works(Q_ROUTER.format("gguf")),
    ("gguf", "cuda"): not_run(CPU_ONLY.format("gguf")),
    ("int8", "lora"): refused(
        "LoRA adapters with --quantization int8 are not supported",
        "tests/test_lora.py::test_lora_needs_enable_lora_and_no_quantization",
        REFUSALS + "test_lora_on_int8_weights_is_refused",
    ),
    ("int8", "spec"): works(Q_SPEC.format("int8")),
    ("int8", "structured"): works(Q_GRPC.format("int8"), Q_ROUTER.format("int8")),
    ("int8", "grpc"): works(Q_GRPC.format("int8")),
    ("int8", "router"): works(Q_ROUTER.format("int8")),
    ("int8", "cuda"): not_run(CPU_ONLY.format("int8")),
    ("lora", "spec"): works(LORA + "test_adapter_with_speculation_gives_the_peft_greedy_tokens"),
    ("lora", "structured"): works(LORA + "test_adapter_keeps_a_json_schema"),
    ("lora", "grpc"): works(
        LORA + "test_grpc_on_a_lora_worker_answers_with_the_base_model",
        note="gRPC's GenerateRequest has no `model` field: gRPC calls get the base model.",
    ),
    ("lora", "router"): works(LORA + "test_router_passes_the_adapter_name_through"),
    ("lora", "cuda"): not_run(NO_GPU),
    ("spec", "structured"): works(
        "tests/test_spec_decode_structured.py::test_greedy_constrained_batch_equals_no_speculation",
        "tests/test_spec_decode_server.py::test_structured_output_with_drafts_answers_as_without",
    ),
    ("spec", "grpc"): works(Q_GRPC.format("int8"), Q_GRPC.format("gguf")),
    ("spec", "router"): works(Q_ROUTER.format("int8"), Q_ROUTER.format("gguf")),
    ("spec", "cuda"): not_run(NO_GPU),
    ("structured", "grpc"): works(
        "tests/test_grpc.py::test_structured_outputs_constrain_generate_and_stream"
    ),
    ("structured", "router"): works(
        Q_ROUTER.format("int8"), TP + "test_router_in_front_of_a_sharded_worker_keeps_the_choice"
    ),
    ("structured", "cuda"): not_run(NO_GPU),
    ("grpc", "router"): refused(
        "unrecognized arguments: --grpc-port",
        REFUSALS + "test_the_router_has_no_grpc_port",
        note="The router proxies HTTP only; gRPC clients call a worker's `--grpc-port`.",
    ),
    ("grpc", "cuda"): not_run(NO_GPU),
    ("router", "cuda"): not_run(
        "The router itself never touches a device; workers on CUDA: " + NO_GPU
    ),
}

MARKS = {"works": "✅", "refused": "⛔", "not run": "❔"}


def ordered_pairs() -> list[tuple[str, str]]:
    return list(combinations(FEATURES, 2))


def cell_problems() -> list[str]:
    """Pairs without a cell, and cells without the evidence their state needs."""
    problems = []
    pairs = ordered_pairs()
    for pair in CELLS:
        if pair not in pairs:
            problems.append(f"{pair}: not a pair of FEATURES in their order")
    for a, b in pairs:
        cell = CELLS.get((a, b))
        name = f"{FEATURES[a]} x {FEATURES[b]}"
        if cell is None:
            problems.append(f"{name}: no cell (needs a test id or a tested refusal)")
        elif cell.state == "not run":
            if not NOT_RUN_ALLOWED & {a, b}:
                problems.append(f"{name}: 'not run' is only allowed for {NOT_RUN_ALLOWED}")
        elif not cell.tests:
            problems.append(f"{name}: {cell.state} without a test id")
        elif cell.state == "refused" and not cell.error:
            problems.append(f"{name}: refused without the error text")
    return problems


def split_test_id(test_id: str) -> tuple[str, str]:
    path, _, name = test_id.partition("::")
    return path, name.partition("[")[0]


def missing_tests(root: Path) -> list[str]:
    """Named test ids whose file or test function does not exist (a static, fast look)."""
    problems = []
    for test_id in sorted({t for cell in CELLS.values() for t in cell.tests}):
        path, function = split_test_id(test_id)
        source = root / path
        if not source.is_file():
            problems.append(f"{test_id}: no file {path}")
        elif not re.search(rf"^def {re.escape(function)}\(", source.read_text(), re.MULTILINE):
            problems.append(f"{test_id}: no test function {function} in {path}")
    return problems


def uncollected_tests(root: Path) -> list[str]:
    """Named test ids (parameters included) that pytest does not collect."""
    test_ids = {t for cell in CELLS.values() for t in cell.tests}
    files = sorted({split_test_id(t)[0] for t in test_ids})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    return [f"{t}: not collected by pytest" for t in sorted(test_ids - collected)]


def render() -> str:
    """The page: the grid (each mark numbered), then one numbered line of evidence per pair."""
    keys = list(FEATURES)
    number = {pair: i for i, pair in enumerate(ordered_pairs(), start=1)}
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by scripts/compat_matrix.py from its CELLS table: edit the table, then",
        "     run `.venv/bin/python scripts/compat_matrix.py`. `make check` fails when this",
        "     page is out of date, a cell lacks a test, or a named test is not collected. -->",
        "",
        "Which features run together. Every cell is backed by a test: ✅ a test runs the two",
        "together; ⛔ the pair is refused with one clear error, and a test checks that error;",
        "❔ not run: CUDA, which no machine of this project has (nothing on CUDA is claimed as",
        "tested). The number in a cell is the line below that names the tests.",
        "",
        "| | " + " | ".join(FEATURES[k] for k in keys) + " |",
        "| --- |" + " :---: |" * len(keys),
    ]
    for row in keys:
        marks = []
        for column in keys:
            if row == column:
                marks.append("—")
                continue
            pair = (row, column) if (row, column) in number else (column, row)
            marks.append(f"{MARKS[CELLS[pair].state]} {number[pair]}")
        lines.append(f"| **{FEATURES[row]}** | " + " | ".join(marks) + " |")
    lines += ["", "## Evidence per pair", ""]
    for pair, n in number.items():
        cell = CELLS[pair]
        what = f"refused: `{cell.error}`" if cell.state == "refused" else cell.state
        line = f"{n}. **{FEATURES[pair[0]]} x {FEATURES[pair[1]]}**: {what}."
        if cell.note:
            line += f" {cell.note}"
        if cell.tests:
            line += " Tests: " + ", ".join(f"`{t}`" for t in cell.tests) + "."
        lines.append(line)
    return "\n".join(lines) + "\n"


def check(root: Path, collect: bool = False) -> list[str]:
    problems = cell_problems() + missing_tests(root)
    page = root / PAGE
    if not problems and (not page.is_file() or page.read_text() != render()):
        problems.append(f"{PAGE}: out of date; run .venv/bin/python scripts/compat_matrix.py")
    if collect and not problems:
        problems += uncollected_tests(root)
    return problems


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    if not argv:
        (root / PAGE).write_text(render())
        print(f"compat_matrix: wrote {PAGE}")
        return 0
    problems = check(root, collect="--collect" in argv)
    for problem in problems:
        print(f"compat_matrix: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
