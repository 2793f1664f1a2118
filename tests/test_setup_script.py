"""`scripts/setup` (m29): which torch build it installs, and from where, read from its
`--dry-run` output (the pip commands it would run; nothing is resolved or installed).

CPU-only torch is the default: `torch==2.13.0+cpu` from the sources pip's configuration names
first (a local wheel folder may hold it), then from PyTorch's CPU wheel index; never a bare
`torch` (on Linux that resolves to the CUDA build). CUDA is taken when `nvidia-smi -L` lists
a GPU or when NANOLLMSERVE_TORCH=cuda asks for it."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.milestone("m29")

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
needs_linux = pytest.mark.skipif(
    platform.system() != "Linux", reason="the CPU/CUDA choice is made on Linux only"
)


def dry_run(tmp_path: Path, *args: str, gpu: bool = False, **env: str) -> list[str]:
    """The pip commands `scripts/setup --dry-run` prints, with a fake `nvidia-smi` first on PATH
    (one that lists a GPU, or one that fails as it does on a machine without a driver)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n"
        if gpu
        else "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n"
    )
    fake.chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if k != "NANOLLMSERVE_TORCH"}
    full_env.update(env, PATH=f"{bin_dir}:{full_env['PATH']}")
    result = subprocess.run(
        [str(ROOT / "scripts/setup"), "--dry-run", *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.splitlines()


def torch_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "pip install" in line and "torch" in line]


@needs_linux
def test_without_a_gpu_setup_takes_the_cpu_wheel_local_first_then_the_cpu_index(tmp_path):
    lines = dry_run(tmp_path)
    assert lines[0] == "torch build: cpu"
    local, index = torch_lines(lines)
    assert local.endswith("pip install -qq torch==2.13.0+cpu")
    assert index.startswith("|| ") and index.endswith(f"torch==2.13.0+cpu {CPU_INDEX}")
    # torch comes first: the project's `torch>=2.4` then finds it installed
    assert lines.index(index) < next(i for i, line in enumerate(lines) if " -e ." in line)


@needs_linux
def test_an_nvidia_gpu_or_the_env_variable_selects_the_cuda_build(tmp_path):
    for lines in (dry_run(tmp_path, gpu=True), dry_run(tmp_path, NANOLLMSERVE_TORCH="cuda")):
        assert lines[0] == "torch build: cuda"
        (only,) = torch_lines(lines)
        assert only.endswith("pip install -qq torch==2.13.0")
        assert "--index-url" not in only
    # ... and asking for the CPU build wins over a GPU being present
    assert dry_run(tmp_path, gpu=True, NANOLLMSERVE_TORCH="cpu")[0] == "torch build: cpu"


def test_no_torch_requirement_is_ever_bare(tmp_path):
    for kwargs in ({}, {"gpu": True}):
        for line in torch_lines(dry_run(tmp_path, **kwargs)):
            assert "torch==2.13.0" in line, line


def test_serving_installs_only_the_runtime_dependencies_tests_get_dev_and_cluster(tmp_path):
    full = dry_run(tmp_path)
    runtime = dry_run(tmp_path, "--runtime")
    assert any(line.endswith("-e .[dev,cluster]") for line in full)
    assert any(line.endswith("-e .") for line in runtime)
    assert not any("[" in line for line in runtime if " -e " in line)
    makefile = (ROOT / "Makefile").read_text()
    serve = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "scripts/setup --runtime" in serve
    assert "NANOLLMSERVE_TORCH=cuda scripts/setup" in makefile.split("\nsetup-cuda:", 1)[1]


def test_an_unknown_torch_build_is_refused_with_the_choices(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as error:
        dry_run(tmp_path, NANOLLMSERVE_TORCH="rocm")
    assert "choose cpu, cuda or auto" in error.value.stderr


def test_cluster_on_ray_without_ray_installed_names_the_extra_to_install():
    """Cluster features need Ray, which only the `cluster` extra installs: a user without it is
    told which extra to install, and the flag's help says so too."""
    block_ray = (
        "import sys; sys.modules['ray'] = None  # as if Ray were not installed\n"
        "from nanollmserve.cli.main import main\n"
        "sys.argv = ['nanollmserve', 'cluster', '--ray-address', 'local', '--router-port', '0']\n"
        "sys.exit(main())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", block_ray], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert "--ray-address needs Ray: pip install 'nanollmserve[cluster]'" in result.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "cluster", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "nanollmserve[cluster]" in help_text
