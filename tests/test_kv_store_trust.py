"""The KV block store (`--kv-offload-dir`, the prefill/decode transport) trusts nothing on
disk (issue 41): a block planted with the right header and name and a recomputed checksum is
never loaded (blocks carry an HMAC with the store's key); a symbolic link in the store is
never followed and nothing outside it is deleted; an ordinary non-empty directory is refused,
never emptied; what the store writes is 0600 in 0700 directories; a directory another user
owns or can write is refused (the CLI exits 2 saying why); a copy of the weights changed in
the middle is another model. Then as two local users (`setpriv` to nobody): the second can
neither read the first's blocks, plant into the store, nor make the first delete anything.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import pytest
from live_server import free_port

from nanollmserve import SamplingParams
from nanollmserve.errors import UserError
from nanollmserve.model.source import bundled_gguf_path

pytestmark = pytest.mark.milestone("m27")

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "A ledger: " + " ".join(f"crate {i} holds {i * 7 % 13} pears;" for i in range(30))
OTHER = "A diary: " + " ".join(f"day {i} brought {i * 3 % 7} storms;" for i in range(30))
NOBODY = 65534
TWO_HOURS = 7200


def run(llm, prompt=PROMPT):
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0]


def block_files(store: Path) -> list[Path]:
    return sorted(store.glob("*/*.kvb"))


def split_block(data: bytes) -> tuple[int, int, dict, int]:
    """(version, prefix size, header, header length) read as an attacker reads them: no key."""
    version, header_len = struct.unpack_from("<II", data, 8)
    prefix = 28 if version == 1 else 56  # version 1: "<8sIIQI"; 2: "<8sIIQ32s"
    return version, prefix, json.loads(data[prefix : prefix + header_len]), header_len


def forge(data: bytes, payload: bytes) -> bytes:
    """`data`'s prefix and header (its name, tokens, layout) with another block's K/V, the
    checksum recomputed as well as one can without the store's key."""
    version, prefix, _, header_len = split_block(data)
    header = data[prefix : prefix + header_len]
    if version == 1:
        crc = zlib.crc32(payload, zlib.crc32(header))
        return data[:24] + struct.pack("<I", crc) + header + payload
    mac = hmac.new(b"attacker's guess".ljust(32, b"!"), digestmod=hashlib.sha256)
    for part in (data[:24], header, payload):
        mac.update(part)
    return data[:24] + mac.digest() + header + payload


def by_tokens(store: Path) -> dict[tuple[int, ...], Path]:
    return {tuple(split_block(p.read_bytes())[2]["token_ids"]): p for p in block_files(store)}


def age(path: Path, seconds: float = TWO_HOURS) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def outside_files(tmp_path: Path) -> Path:
    """A directory outside any store with old files in it (what a planted link points at)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("notes.txt", "ab" * 16 + ".kvb", "x.1.0badf00d.tmp"):
        (outside / name).write_text("mine, not the store's\n")
        age(outside / name)
    return outside


@pytest.mark.timeout(300)
def test_a_forged_block_with_a_recomputed_checksum_is_never_loaded(make_llm, tmp_path):
    store = tmp_path / "kv"
    llm = make_llm(kv_offload_dir=str(store))
    reference, other = run(llm), run(llm, OTHER)
    llm.shutdown()
    mine, theirs = by_tokens(store), by_tokens(store)
    ids, other_ids = reference.prompt_token_ids, other.prompt_token_ids
    forged = 0
    for i in range((min(len(ids), len(other_ids)) - 1) // BLOCK):
        path = mine[tuple(ids[i * BLOCK : (i + 1) * BLOCK])]
        donor = theirs[tuple(other_ids[i * BLOCK : (i + 1) * BLOCK])].read_bytes()
        version, prefix, _, header_len = split_block(donor)
        path.write_bytes(forge(path.read_bytes(), donor[prefix + header_len :]))
        forged += 1
    assert forged >= 3

    victim = run(make_llm(kv_offload_dir=str(store)))
    assert victim.num_cached_tokens == 0, "a forged block was loaded"
    assert victim.outputs[0].token_ids == reference.outputs[0].token_ids


@pytest.mark.timeout(300)
def test_a_link_in_the_store_is_never_followed_and_nothing_outside_is_deleted(make_llm, tmp_path):
    store = tmp_path / "kv"
    llm = make_llm(kv_offload_dir=str(store))
    cold = run(llm)
    llm.shutdown()
    outside = outside_files(tmp_path)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    (store / "zz").symlink_to(outside)  # a shard-like name and a non-shard one
    (store / "ab").symlink_to(outside)
    shard = block_files(store)[0].parent
    (shard / ("cd" * 16 + ".kvb")).symlink_to(outside / "notes.txt")

    warm = run(make_llm(kv_offload_dir=str(store), kv_offload_max_bytes=1))  # evicts all
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before
    assert (store / "zz").is_symlink() and (store / "ab").is_symlink()


@pytest.mark.timeout(300)
def test_an_ordinary_non_empty_directory_is_refused_never_emptied(make_llm, tmp_path):
    home = tmp_path / "home"
    (home / "ab").mkdir(parents=True)
    for path in (home / "ab" / "old.txt", home / "ab" / ("ef" * 16 + ".kvb"), home / "x.txt"):
        path.write_text("a user's file\n")
        age(path)
    with pytest.raises(UserError, match="not a KV block store"):
        make_llm(kv_offload_dir=str(home), kv_offload_max_bytes=1)
    assert sorted(p.name for p in home.rglob("*")) == sorted(
        ["ab", "old.txt", "ef" * 16 + ".kvb", "x.txt"]
    )
    run(make_llm(kv_offload_dir=str(home / "kv")))  # a new subdirectory is fine


@pytest.mark.timeout(300)
def test_what_the_store_writes_is_owner_only(make_llm, tmp_path):
    old_umask = os.umask(0o022)
    try:
        store = tmp_path / "kv"
        llm = make_llm(kv_offload_dir=str(store))
        run(llm)
        llm.shutdown()
    finally:
        os.umask(old_umask)
    paths = [store, *store.rglob("*")]
    files = [p for p in paths if p.is_file()]
    assert len(block_files(store)) >= 3 and len(files) >= len(block_files(store)) + 2
    for path in paths:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"


@pytest.mark.timeout(300)
def test_a_store_others_can_write_stops_serve_with_exit_2(tmp_path):
    store = tmp_path / "kv"
    store.mkdir()
    store.chmod(0o777)
    command = [sys.executable, "-m", "nanollmserve.cli.main", "serve"]
    command += ["--port", str(free_port()), "--kv-offload-dir", str(store)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("serve started on a world-writable --kv-offload-dir")
    assert process.returncode == 2, err[-2000:]
    assert "writable by group or others" in err and str(store) in err, err[-2000:]


@pytest.mark.timeout(300)
def test_a_store_another_user_owns_is_refused(make_llm, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another user (chown)")
    store = tmp_path / "kv"
    store.mkdir(mode=0o700)
    os.chown(store, NOBODY, NOBODY)
    with pytest.raises(UserError, match="owned by another user"):
        make_llm(kv_offload_dir=str(store))


@pytest.mark.timeout(300)
def test_weights_changed_in_the_middle_are_another_model(make_llm, tmp_path):
    original = bundled_gguf_path()
    copy = tmp_path / original.name  # the same file name, size, first and last MiB
    shutil.copyfile(original, copy)
    size = copy.stat().st_size
    with open(copy, "r+b") as f:
        f.seek(size // 2 - (2 << 20))
        f.write(bytes(4 << 20))  # 4 MiB of tensor data zeroed in the middle
    store = tmp_path / "kv"
    llm = make_llm(model=str(original), kv_offload_dir=str(store), dtype="auto")
    assert run(llm).num_cached_tokens == 0
    llm.shutdown()
    changed = run(make_llm(model=str(copy), kv_offload_dir=str(store), dtype="auto"))
    assert changed.num_cached_tokens == 0, "the changed weights loaded the other model's K/V"


# Two local users: root (the server) and nobody (the other user), through setpriv.


def as_nobody(script: str) -> subprocess.CompletedProcess:
    command = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]
    return subprocess.run([*command, "sh", "-c", script], capture_output=True, text=True)


@pytest.fixture
def shared_tmp():
    """A directory every user can write (sticky, like /tmp), outside pytest's private one."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as a second local user (setpriv --reuid)")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to act as a second local user")
    base = Path(tempfile.mkdtemp(prefix="nls-two-users-", dir="/tmp"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(300)
def test_another_user_can_neither_read_nor_plant_in_a_store(make_llm, shared_tmp):
    store = shared_tmp / "kv"
    llm = make_llm(kv_offload_dir=str(store))
    cold = run(llm)
    llm.shutdown()
    block = block_files(store)[0]
    assert as_nobody("true").returncode == 0
    read = as_nobody(f"cat '{block}' > /dev/null")
    listing = as_nobody(f"ls '{store}'")
    plant = as_nobody(f"touch '{store}/zz' || touch '{block.parent}/{'ab' * 16}.kvb'")
    assert read.returncode != 0, "another user read a block (its prompt's token ids)"
    assert listing.returncode != 0, "another user listed the store"
    assert plant.returncode != 0, "another user planted a file in the store"
    warm = run(make_llm(kv_offload_dir=str(store)))
    assert warm.num_cached_tokens > 0
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids


@pytest.mark.timeout(300)
def test_another_user_cannot_make_a_server_delete_through_a_store_they_made(make_llm, shared_tmp):
    victim = shared_tmp / "victim"
    victim.mkdir(mode=0o700)
    for name in ("notes.txt", "cd" * 16 + ".kvb"):
        (victim / name).write_text("the first user's file\n")
        age(victim / name)
    store = shared_tmp / "kv"
    made = as_nobody(f"mkdir -m 755 '{store}' && ln -s '{victim}' '{store}/zz'")
    assert made.returncode == 0, made.stderr
    linked = shared_tmp / "kv-link"
    made = as_nobody(f"ln -s '{victim}' '{linked}'")
    assert made.returncode == 0, made.stderr

    with pytest.raises(UserError, match="owned by another user"):
        run(make_llm(kv_offload_dir=str(store), kv_offload_max_bytes=1))
    with pytest.raises(UserError, match="owned by another user"):
        run(make_llm(kv_offload_dir=str(linked), kv_offload_max_bytes=1))
    assert sorted(p.name for p in victim.iterdir()) == ["cd" * 16 + ".kvb", "notes.txt"]


def cluster_cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "nanollmserve.cli.main", "cluster", "--router-port", "0"]
    command += ["--prefill-workers", "1", "--decode-workers", "1", *args]
    try:
        return subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=90)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"cluster {' '.join(args)} did not stop at once: it started its workers")


@pytest.mark.timeout(300)
def test_the_cluster_launcher_checks_the_store_and_makes_its_key_before_any_worker(tmp_path):
    open_store = tmp_path / "open"
    open_store.mkdir()
    open_store.chmod(0o777)
    refused = cluster_cli("--kv-offload-dir", str(open_store))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "writable by group or others" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr[-2000:]
    assert list(open_store.iterdir()) == []

    store = tmp_path / "kv"
    stopped = cluster_cli("--kv-offload-dir", str(store), "--no-such-flag")  # after the store
    assert stopped.returncode == 2 and "--no-such-flag" in stopped.stderr, stopped.stderr
    key = store / ".nanollmserve-kv-key"
    assert key.is_file(), "the launcher made no key for its workers"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.stat().st_mode) == 0o700
