"""Shared pytest setup for the nanollmserve test suite.

The first section is the milestone plugin: `pytest --milestone m05` (or `M=m05 make test`)
keeps only the tests marked `@pytest.mark.milestone("m05")`; several ids may be given
comma-separated (`--milestone m05,m06`). The `milestone` marker itself is registered in
pyproject.toml. Shared fixtures go in the second section, below the plugin.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["compat_evidence"]  # the compat matrix's evidence (compat_evidence.py)

# ---------------------------------------------------------------------------------------------
# Milestone plugin (keep small; see docs/MILESTONES_GUIDE.md, "The marker rule")
# ---------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--milestone",
        action="store",
        default=None,
        metavar="mNN[,mNN...]",
        help="run only the tests marked @pytest.mark.milestone('mNN')",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    option = config.getoption("--milestone")
    if not option:
        return
    wanted = {name.strip() for name in option.split(",") if name.strip()}
    selected, deselected = [], []
    for item in items:
        names = {mark.args[0] for mark in item.iter_markers("milestone") if mark.args}
        (selected if names & wanted else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


# ---------------------------------------------------------------------------------------------
# Shared fixtures (add below)
# ---------------------------------------------------------------------------------------------


def assert_no_leak(llm) -> None:
    """The engine holds no request and every KV block is back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.num_kv_blocks
    assert engine.kv_cache.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in engine.kv_cache.pool.blocks)


@pytest.fixture
def make_llm():
    """`make_llm(**engine_args)`: an LLM on the bundled model in float32; at teardown every
    engine it built must hold no request and no block (no leak)."""
    from nanollmserve import LLM

    built = []

    def make(**engine_args):
        engine_args.setdefault("dtype", "float32")
        engine_args.setdefault("num_kv_blocks", 512)
        llm = LLM(**engine_args)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        assert_no_leak(llm)


@pytest.fixture(scope="session")
def shared_llm():
    from nanollmserve import LLM

    return LLM(dtype="float32", num_kv_blocks=512)


@pytest.fixture
def llm(shared_llm):
    """One LLM (bundled model, float32) shared by the tests; leak-checked after each test."""
    yield shared_llm
    assert_no_leak(shared_llm)
