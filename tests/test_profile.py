"""`nanollmserve profile` (/proc sampling) and `scripts/profile.sh` (+ perf stat where it can)
against short-lived child processes."""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanollmserve.cli import profile
from nanollmserve.cli.main import main
from nanollmserve.cli.profile import CLOCK_TICKS, read_sample

pytestmark = [
    pytest.mark.milestone("m10"),
    pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc"),
]

ROOT = Path(__file__).resolve().parent.parent
BUSY = "import threading, time\nt = time.time()\nwhile time.time() - t < {s}: pass\n"


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def run_profile(*argv: str) -> int:
    """The subcommand alone (main() would import every other subcommand, torch included)."""
    parser = argparse.ArgumentParser()
    profile.register(parser.add_subparsers())
    args = parser.parse_args(["profile", *argv])
    return args.func(args)


def test_profile_busy_process_json_and_csv(tmp_path, capsys):
    child = spawn(BUSY.format(s=10))
    try:
        out_csv = tmp_path / "samples.csv"
        argv = ["--pid", str(child.pid), "--duration", "1", "--interval", "0.2"]
        assert run_profile(*argv, "--csv", str(out_csv)) == 0
    finally:
        child.kill()
        child.wait()
    summary = json.loads(capsys.readouterr().out)
    assert summary["pid"] == child.pid and not summary["exited"]
    assert summary["duration_s"] == pytest.approx(1.0, abs=0.3)
    assert summary["num_samples"] >= 5
    assert summary["cpu_s"] > 0.2 and summary["cpu_percent"] > 20  # a busy loop
    assert summary["rss_mb"]["max"] > 1 and summary["vm_peak_mb"] >= summary["rss_mb"]["max"]
    assert summary["threads"]["min"] >= 1
    for key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
        assert summary[key] >= 0 and f"{key}_per_s" in summary
    rows = list(csv.DictReader(out_csv.open()))
    assert len(rows) == summary["num_samples"]
    assert set(rows[0]) >= {"elapsed_s", "rss_kb", "vm_peak_kb", "threads", "cpu_s"}


def test_profile_table_and_a_process_that_exits(capsys):
    child = spawn("import time; time.sleep(0.6)")
    try:
        argv = ["--pid", str(child.pid), "--duration", "5", "--interval", "0.1"]
        assert run_profile(*argv, "--format", "table") == 0
    finally:
        child.wait()
    table = capsys.readouterr().out
    assert "rss" in table and "involuntary ctxt switches" in table
    assert "the process exited during sampling" in table


def test_profile_unknown_pid_is_one_line_error(capsys):
    assert main(["profile", "--pid", "999999999", "--duration", "1"]) == 2
    assert "no process 999999999" in capsys.readouterr().err


def test_read_sample_parses_a_command_name_with_spaces_and_parens(tmp_path):
    proc = tmp_path / "42"
    proc.mkdir()
    (proc / "status").write_text(
        "Name:\tx\nVmPeak:\t  2048 kB\nVmRSS:\t  1024 kB\nThreads:\t7\n"
        "voluntary_ctxt_switches:\t11\nnonvoluntary_ctxt_switches:\t3\n"
    )
    fields = ["S"] + ["0"] * 10 + [str(3 * CLOCK_TICKS), str(CLOCK_TICKS)] + ["0"] * 30
    (proc / "stat").write_text(f"42 (my (odd) name) {' '.join(fields)}\n")
    sample = read_sample(42, 0.0, proc=tmp_path)
    assert (sample.rss_kb, sample.vm_peak_kb, sample.threads) == (1024, 2048, 7)
    assert (sample.voluntary_ctxt_switches, sample.nonvoluntary_ctxt_switches) == (11, 3)
    assert sample.cpu_s == 4.0


def test_profile_script_reports_perf(tmp_path):
    child = spawn("import time; time.sleep(30)")
    try:
        result = subprocess.run(
            [str(ROOT / "scripts/profile.sh"), str(child.pid), "1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        child.kill()
        child.wait()
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pid"] == child.pid
    # Either perf's counters follow, or the script says why there are none.
    assert "perf stat -p" in result.stderr or "perf not found" in result.stderr
