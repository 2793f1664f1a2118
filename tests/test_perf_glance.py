"""Performance at a glance (m29, issue 42): the table in README.md and docs/index.md is the
one scripts/perf_glance.py generates from the benchmark JSON, each row naming the CPU, our ISA
build, the GGUF file, the llama.cpp peer's build flags (AMX off where it was turned off), the
commit, the command and the record; a
record without that provenance is no headline row; a hand-edited table fails the check."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.milestone("m29"), pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent


def _perf_glance():
    spec = importlib.util.spec_from_file_location("perf_glance", ROOT / "scripts/perf_glance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


perf_glance = _perf_glance()


def test_the_pages_carry_the_generated_table_with_full_provenance() -> None:
    assert perf_glance.problems(ROOT) == []
    table = perf_glance.render(ROOT, "docs/")
    rows = [line for line in table.splitlines() if "| `" in line and "cores" in line]
    bundled = [row for row in rows if row.startswith(f"| {perf_glance.BUNDLED} |")]
    assert {row.split("`")[1] for row in bundled} == {"amx", "avx512", "avx2"}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        gguf, isa, cpu, *ratios, peer, commit, command, file = cells
        assert "cores" in cpu and all(r.endswith("x") for r in ratios)
        record = json.loads((ROOT / file.split("](")[1].rstrip(")")).read_text())
        assert gguf == perf_glance.model_file(record["provenance"])
        if record["provenance"]["peer"]["cmake"].get("GGML_NATIVE") != "ON":
            assert "AMX off (its AMX build crashed)" in peer
        else:  # built for a CPU without AMX: nothing was turned off
            assert "NATIVE" in peer and "AMX off" not in peer
        assert len(commit.strip("`")) >= 7 and "scripts/bench-batched" in command
        target = file.split("](")[1].rstrip(")")
        assert (ROOT / target).is_file()
        record = json.loads((ROOT / target).read_text())
        assert record["provenance"]["native_isa"] == isa.strip("`")
        assert ratios[-1] == f"{record['rows']['c32']['output_tok_s_ratio']:.2f}x"


def test_a_stale_table_and_a_record_without_provenance(tmp_path) -> None:
    bench = tmp_path / "docs/assets/bench"
    bench.mkdir(parents=True)
    shutil.copy(ROOT / "docs/assets/bench/stop36/batched-avx2-50e60fa.json", bench / "a.json")
    no_peer = json.loads((bench / "a.json").read_text())
    no_peer["provenance"].pop("peer")
    no_peer["provenance"]["native_isa"] = "amx"
    (bench / "b.json").write_text(json.dumps(no_peer))
    # b.json has no peer flags
    assert set(perf_glance.headline_records(tmp_path)) == {("avx2", perf_glance.BUNDLED)}
    markers = f"x\n{perf_glance.START}\n| old | 9.99x |\n{perf_glance.END}\ny\n"
    (tmp_path / "docs/index.md").write_text(markers)
    (tmp_path / "README.md").write_text(markers)
    found = perf_glance.problems(tmp_path)
    assert len(found) == 2 and all("not current" in problem for problem in found)
    (tmp_path / "README.md").write_text(
        perf_glance.replaced(markers, perf_glance.render(tmp_path, "docs/"))
    )
    assert perf_glance.problems(tmp_path) == [
        "docs/index.md: the performance table is not current: python scripts/perf_glance.py"
    ]
