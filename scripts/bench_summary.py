"""Markdown tables for docs/benchmarks.md from the JSON files scripts/bench-all writes.

    python scripts/bench_summary.py docs/assets/bench > summary.md

Each table matches a results table of docs/benchmarks.md; a benchmark whose JSON is missing
(not run, or failed) is skipped. `*-llamacpp-*` files are llama.cpp's native llama-server;
`*-llamacpp-python-*` files are llama-cpp-python's server (one request at a time), labelled
as such.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def table(title: str, header: list[str], rows: list[list]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" for _ in header) + " |")
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


NATIVE = "llama.cpp llama-server"
PYTHON = "llama-cpp-python server (one request at a time)"


def label_of(name: str, r: dict) -> str:
    """The row label of a serve JSON: ours / ours-int8 from the file name; a llama.cpp row
    by the `peer` block scripts/bench-all adds. A llamacpp file without one was measured
    against llama-cpp-python's server, before the native peer existed."""
    stem = name.removeprefix("serve-").rsplit("-c", 1)[0]
    if "llamacpp" not in stem:
        return stem
    server = (r.get("peer") or {}).get("server", "")
    if server.startswith("llama.cpp"):
        return NATIVE
    return PYTHON if server else f"{PYTHON}, recorded before the native peer"


def serve_row(label: str, r: dict) -> list:
    return [
        label,
        r["max_concurrency"],
        f"{r['completed']}/{r['failed']}",
        r["request_throughput"],
        r["output_throughput"],
        r["ttft_ms"]["p50"],
        r["ttft_ms"]["p95"],
        r["tpot_ms"]["p50"],
        r["itl_ms"]["p95"],
        r["e2el_ms"]["p50"],
    ]


SERVE_HEADER = [
    "run", "concurrency", "done/failed", "req/s", "output tok/s", "TTFT p50 ms",
    "TTFT p95 ms", "TPOT p50 ms", "ITL p95 ms", "E2E p50 ms",
]  # fmt: skip


def peer_ratios(out: Path) -> str:
    """Ours (bf16, and int8 weights where measured) / llama.cpp: output tok/s at each
    concurrency both ran, and single-stream decode tok/s (1000 / TPOT p50)."""
    lines = []
    for prefix, label in (("serve-ours-c", "ours"), ("serve-ours-int8-c", "ours int8")):
        for name in sorted(p.stem for p in out.glob(f"{prefix}*.json")):
            level = name.removeprefix(prefix)
            ours, peer = load(out, name), load(out, f"serve-llamacpp-c{level}")
            if not peer:
                continue
            lines.append(
                f"- {label}, concurrency {level}: output tok/s {label} / "
                f"{label_of('serve-llamacpp', peer)} = "
                f"{ours['output_throughput'] / peer['output_throughput']:.2f}"
            )
            if level == "1" and ours["tpot_ms"]["p50"] and peer["tpot_ms"]["p50"]:
                lines.append(
                    f"- {label}, single stream: decode tok/s {1000 / ours['tpot_ms']['p50']:.1f}"
                    f" vs llama.cpp {1000 / peer['tpot_ms']['p50']:.1f}, ratio "
                    f"{peer['tpot_ms']['p50'] / ours['tpot_ms']['p50']:.2f}"
                )
    return "\n".join(lines) + "\n"


def main(out: Path) -> None:
    parts = []
    if machine := load(out, "machine"):
        parts.append(
            f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
            f"git {machine['git']}, {machine['date']}.\n"
        )
    for name in ("latency", "latency-fp32", "latency-fp16"):
        if not (r := load(out, name)):
            continue
        rows = [
            [system, s["ttft_ms"], s["tpot_ms"], s["decode_tokens_per_s"], s["tokens_per_s"]]
            for system, s in r["results"].items()
        ]
        header = ["system", "TTFT ms", "TPOT ms", "decode tok/s", "end-to-end tok/s"]
        weights = f", weights {r['quantization']}" if r.get("quantization") else ""
        parts.append(table(f"{name} ({r['dtype']}{weights}; ratios {r['ratios']})", header, rows))
    if r := load(out, "throughput"):
        rows = [
            [name, s["requests"], s["requests_per_s"], s["output_tokens_per_s"]]
            for name, s in r["results"].items()
        ]
        parts.append(
            table(
                f"throughput ({r['dtype']}; ratios {r['ratios']})",
                ["system", "requests", "req/s", "output tok/s"],
                rows,
            )
        )
    if r := load(out, "blocks"):
        rows = [
            [
                name,
                s["utilization"],
                s["wasted_tokens_per_request"],
                s["max_concurrent_requests_in_budget"],
            ]
            for name, s in r["schemes"].items()
        ]
        header = ["scheme", "utilization", "wasted tokens/request", "requests in budget"]
        parts.append(table("blocks", header, rows))
    if r := load(out, "serve-sweep"):
        rows = [serve_row("ours", run) for run in r["sweep"]]
        parts.append(table("serve sweep", SERVE_HEADER, rows))
    if r := load(out, "serve-shared-prefix"):
        hit = (r.get("server") or {}).get("prefix_cache_hit_rate")
        parts.append(
            table(f"serve shared-prefix (hit rate {hit})", SERVE_HEADER, [serve_row("ours", r)])
        )
    if r := load(out, "serve-http-vs-grpc"):
        rows = [serve_row(name, r[name]) for name in ("openai", "grpc")]
        ratios = ", ".join(f"{k} {v}" for k, v in (r.get("ratios") or {}).items())
        parts.append(table("serve: HTTP vs gRPC", SERVE_HEADER, rows) + f"\n{ratios}\n")
    names = [p.stem for p in out.glob("serve-*-c*.json") if not p.stem.startswith("serve-sweep")]
    rows_by_name = {name: load(out, name) for name in names}
    labelled = sorted(
        ((label_of(name, r), int(name.rsplit("-c", 1)[1]), r) for name, r in rows_by_name.items()),
        key=lambda row: row[:2],
    )
    peer_rows = [serve_row(label, r) for label, _, r in labelled]
    if peer_rows:
        parts.append(table("peer: llama.cpp vs ours", SERVE_HEADER, peer_rows))
        parts.append(peer_ratios(out))
    rows = []
    for name in ("mini-vllm", "mini-vllm-llamacpp"):
        if r := load(out, name):
            label = "ours" if name == "mini-vllm" else label_of(name, r)
            rows.append(
                [
                    label, r["model"], r["num_prompts"], r["max_concurrency"],
                    f"{r['completed']}/{r['failed']}", r["request_throughput"],
                    r["output_throughput"], r["ttft_ms"]["p50"], r["e2el_ms"]["p50"],
                ]
            )  # fmt: skip
    if rows:
        header = ["run", "model", "requests", "concurrency", "done/failed", "req/s",
                  "output tok/s", "TTFT p50 ms", "E2E p50 ms"]  # fmt: skip
        rows.append(
            ["Mini-vLLM write-up (CPU)", "not named", 500, 50, "500/0", 1308, "39,239",
             "p50 16.5 ms (metric not named)", ""]
        )  # fmt: skip
        parts.append(table("mini-vllm preset", header, rows))
    rows = []
    prefix_runs = (
        ("prefix", "ours, offline engine (no HTTP; compare with nothing)"),
        ("prefix-ours", "ours, server over HTTP"),
        ("prefix-llamacpp", ""),
    )
    for name, label in prefix_runs:
        if r := load(out, name):
            rows.append(
                [
                    label or f"{label_of(name, r)} over HTTP",
                    r["cold_ttft_ms"]["p50"],
                    r["cold_ttft_ms"]["p95"],
                    r["warm_ttft_ms"]["p50"],
                    r["warm_ttft_ms"]["p95"],
                    r["warm_over_cold_p50"],
                    r["hit_rate"],
                ]
            )
    if rows:
        header = ["run", "cold p50 ms", "cold p95 ms", "warm p50 ms", "warm p95 ms",
                  "warm/cold", "hit rate"]  # fmt: skip
        parts.append(table("prefix", header, rows))
    if r := load(out, "ablation"):
        rows = [
            [
                name,
                s["output_tokens_per_s"],
                s["ttft_p50_ms"],
                s["ttft_p95_ms"],
                s["itl_p95_ms"],
                s.get("prefix_cache_hit_rate", ""),
            ]
            for name, s in r["systems"].items()
        ]
        header = ["system", "output tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p95 ms", "hit rate"]
        parts.append(table(f"ablation ({r['dtype']})", header, rows))
    print("\n".join(parts))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/assets/bench"))
