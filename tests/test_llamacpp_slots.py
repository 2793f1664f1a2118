"""llama.cpp's slot actions (`POST /slots/{id}?action=save|restore|erase`) behind
`--slot-save-path`, through HTTP on one live server of the bundled model: a saved slot is
its sequence's cached KV blocks plus its tokens; restoring it puts them back into the prefix
cache (the same request then hits it and answers the same greedy text); erasing drops its
blocks from the prefix cache and from the `--kv-offload-dir` tier; a changed file, a
file of another model, a hostile file name, a link and a slot out of range are refused;
a directory others can write is refused at start; with an admin key on the server the
actions need it. The refusal without the flag is tested on the shared server
(tests/test_llamacpp_server_info.py)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
import uuid

import pytest
from live_server import API_KEY, SHARED_ARGS, LiveServer

from nanollmserve.api.serving import ServerContext
from nanollmserve.engine import slot_save
from nanollmserve.errors import UserError
from nanollmserve.kv_store_dir import KEY_FILE
from nanollmserve.server_settings import ServerSettings

pytestmark = [pytest.mark.milestone("m30"), pytest.mark.timeout(120)]

ADMIN_KEY = "test-admin-key-slots"


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slots") / "saved"


@pytest.fixture(scope="module")
def server(slot_dir):
    """With an offload tier too: an erased slot's blocks must not come back from its files."""
    server = LiveServer.start(
        *SHARED_ARGS,
        "--slot-save-path",
        str(slot_dir),
        "--kv-offload-dir",
        str(slot_dir.parent / "offload"),
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    """The API key's client (completions) that also sends the admin key on slot actions:
    with an admin key on the server, the slot actions need it."""
    with server.client() as client:
        yield client


def _prompt() -> str:
    words = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(30))
    return f"Here is a list of code words to remember: {words}. The first word is"


def _complete(client, prompt: str) -> dict:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0}
    response = client.post("/completion", json=body)
    assert response.status_code == 200, response.text
    return response.json()


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _action(client, action: str, slot: int = 0, **body):
    return client.post(
        f"/slots/{slot}", params={"action": action}, json=body or None, headers=ADMIN
    )


def test_save_erase_restore_then_the_prompt_hits_the_cache(server, client, slot_dir):
    prompt = _prompt()
    first = _complete(client, prompt)
    assert first["tokens_cached"] == 0
    server.wait_idle()

    saved = _action(client, "save", filename="round.bin")
    assert saved.status_code == 200, saved.text
    saved = saved.json()
    assert saved["id_slot"] == 0 and saved["filename"] == "round.bin"
    assert saved["n_saved"] >= 32 and saved["timings"]["save_ms"] >= 0
    info = os.lstat(slot_dir / "round.bin")
    assert saved["n_written"] == info.st_size and stat.S_IMODE(info.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(slot_dir).st_mode) == 0o700

    erased = _action(client, "erase").json()
    expected = first["tokens_evaluated"] + first["tokens_predicted"]
    assert erased == {"id_slot": 0, "n_erased": expected}
    again = _complete(client, prompt)  # its blocks and their offload files went: computed anew
    assert again["tokens_cached"] == 0 and again["content"] == first["content"]
    server.wait_idle()
    assert _action(client, "erase").json()["n_erased"] == expected

    restored = _action(client, "restore", filename="round.bin").json()
    assert restored["id_slot"] == 0 and restored["filename"] == "round.bin"
    assert restored["n_restored"] == saved["n_saved"]
    assert restored["n_read"] == saved["n_written"] and restored["timings"]["restore_ms"] >= 0
    hit = _complete(client, prompt)
    assert hit["tokens_cached"] >= 32 and hit["content"] == first["content"]
    # The OpenAI route takes the same blocks.
    usage = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
    ).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 32


def _tamper(path, new_path, change):
    """Rewrite a slot file's header through `change(fields)`, re-MACed with the directory's
    key (what only the server's user can do): the server still checks what it says."""
    data = path.read_bytes()
    prefix = slot_save._PREFIX
    _, version, header_len, body_len, _ = prefix.unpack_from(data)
    fields = json.loads(data[prefix.size : prefix.size + header_len])
    change(fields)
    header = json.dumps(fields).encode()
    body = data[prefix.size + header_len :]
    key = bytes.fromhex((path.parent / KEY_FILE).read_text().strip())
    maced = slot_save._MACED.pack(slot_save.SLOT_MAGIC, version, len(header), body_len)
    new_path.write_bytes(maced + slot_save._mac(key, maced, header, body) + header + body)
    new_path.chmod(0o600)


def test_changed_and_foreign_files_are_refused(server, client, slot_dir):
    _complete(client, _prompt())
    server.wait_idle()
    assert _action(client, "save", filename="good.bin").status_code == 200
    data = bytearray((slot_dir / "good.bin").read_bytes())
    data[len(data) // 2] ^= 0x01
    (slot_dir / "flipped.bin").write_bytes(bytes(data))
    (slot_dir / "flipped.bin").chmod(0o600)
    response = _action(client, "restore", filename="flipped.bin")
    assert response.status_code == 400 and "MAC mismatch" in response.json()["error"]["message"]

    def other_model(fields):
        fields["layout"]["model_id"] = "another-model:0123:dense"

    _tamper(slot_dir / "good.bin", slot_dir / "other.bin", other_model)
    response = _action(client, "restore", filename="other.bin")
    assert response.status_code == 400
    assert "another model" in response.json()["error"]["message"]

    def other_tokens(fields):
        fields["token_ids"][0] += 1

    _tamper(slot_dir / "good.bin", slot_dir / "tokens.bin", other_tokens)
    response = _action(client, "restore", filename="tokens.bin")
    assert response.status_code == 400 and "block 0" in response.json()["error"]["message"]
    assert _action(client, "restore", filename="good.bin").status_code == 200


HOSTILE = ["../x", "/etc/passwd", "", "a" * 300, "a\x00b", ".nanollmserve-kv-key", "a/b", ".."]


@pytest.mark.parametrize("action", ["save", "restore"])
def test_hostile_file_names_are_400s(client, action):
    for name in [*HOSTILE, None, 7]:
        response = _action(client, action, filename=name)
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == "filename"
    response = client.post("/slots/0", params={"action": action}, headers=ADMIN)
    assert response.status_code == 400


def test_links_are_never_followed(client, slot_dir, tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"not a slot")
    (slot_dir / "link.bin").symlink_to(target)
    response = _action(client, "restore", filename="link.bin")
    assert response.status_code == 400 and "cannot read" in response.json()["error"]["message"]
    assert _action(client, "save", filename="link.bin").status_code == 200
    assert target.read_bytes() == b"not a slot"  # the link was replaced, not written through
    assert not os.path.islink(slot_dir / "link.bin")
    missing = _action(client, "restore", filename="missing.bin")
    assert missing.status_code == 400 and "no such file" in missing.json()["error"]["message"]


def test_slots_out_of_range_and_the_keys(server, client):
    num_slots = len(client.get("/slots").json())
    for slot in (num_slots, -1):
        response = _action(client, "save", slot=slot, filename="x.bin")
        assert response.status_code == 400 and response.json()["error"]["param"] == "id_slot"
    # With an admin key on the server the slot actions are the operator's: the API key
    # (which opens /slots and the completions) does not open them, nor does a wrong key.
    for key in (API_KEY, "wrong"):
        response = server.client().post(
            "/slots/0", params={"action": "erase"}, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_admin_api_key"
    assert client.get("/slots").status_code == 200


def test_a_directory_others_can_write_is_refused_at_start(tmp_path):
    engine = types.SimpleNamespace(model_name="m", enable_slot_save=lambda: None)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UserError) as refused:
        ServerContext(engine, ServerSettings(slot_save_path=str(shared)))
    assert "the --slot-save-path directory" in str(refused.value)  # not "the KV store's"
    assert "KV store" not in str(refused.value)
    ours = tmp_path / "ours"
    ctx = ServerContext(engine, ServerSettings(slot_save_path=str(ours)))
    assert ctx.slot_dir[0] == ours and stat.S_IMODE(os.stat(ours).st_mode) == 0o700
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a KV block store"):
        ServerContext(engine, ServerSettings(slot_save_path=str(busy)))


def test_serve_refuses_that_directory_before_loading_the_model(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    command = [sys.executable, "-m", "nanollmserve.cli.main", "serve"]
    command += ["--slot-save-path", str(shared), "--port", "0"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "--slot-save-path" in result.stderr and "writable" in result.stderr


@pytest.mark.parametrize("admin_key", [None, "admin-key"])
def test_which_key_opens_the_slot_actions(admin_key):
    """The middlewares as app.py stacks them, around a stand-in route: without an admin key
    the API key opens the slot actions (as on llama.cpp); with one, only the admin key does.
    `GET /slots` stays the API key's either way."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from nanollmserve.api.auth import AdminKeyMiddleware, APIKeyMiddleware

    def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/slots", ok), Route("/slots/{id}", ok, methods=["POST"])])
    app.add_middleware(
        APIKeyMiddleware, api_key="api-key", admin_slot_actions=admin_key is not None
    )
    app.add_middleware(AdminKeyMiddleware, admin_api_key=admin_key)
    client = TestClient(app)

    def status(method, path, key):
        return client.request(method, path, headers={"Authorization": f"Bearer {key}"})

    assert status("GET", "/slots", "api-key").status_code == 200
    assert status("GET", "/slots", "admin-key").status_code == 401
    if admin_key is None:
        assert status("POST", "/slots/0", "api-key").status_code == 200
        assert status("POST", "/slots/0", "admin-key").status_code == 401
    else:
        assert status("POST", "/slots/0", "api-key").status_code == 401
        assert status("POST", "/slots/0", "admin-key").status_code == 200


def test_places_are_taken_lowest_first_and_remember_what_finished_there():
    unused = slot_save.SlotTable(1)  # without --slot-save-path no place keeps a prompt
    unused.assign("x", savable=True)
    unused.record("x", [1, 2], [3])
    assert unused.tokens == [None]
    table = slot_save.SlotTable(2)
    table.keep_tokens = True
    for request_id in ("a", "b", "c"):  # c waits: both places are held
        table.assign(request_id, savable=True)
    table.record("b", [1], [2])
    table.release("b")  # c takes place 1
    assert table.tokens == [None, [1, 2]] and table.busy() == [True, True]
    table.record("c", [3], [])
    table.release("c")
    assert table.tokens == [None, [3]] and table.busy() == [True, False]  # GET /slots
    table.assign("salted", savable=False)  # a LoRA or cache_salt request: never remembered
    table.record("salted", [4], [])
    table.release("salted")
    table.record("a", [], [5])
    table.release("a")
    assert table.tokens == [[5], [3]]
    assert table.busy() == [False, False]
    table.release("unknown")  # an id that never got a place (refused at admission)
