"""Shared pytest setup for the nanollmserve test suite.

The first section is the milestone plugin: `pytest --milestone m05` (or `M=m05 make test`)
keeps only the tests marked `@pytest.mark.milestone("m05")`; several ids may be given
comma-separated (`--milestone m05,m06`). The `milestone` marker itself is registered in
pyproject.toml. Shared fixtures go in the second section, below the plugin.
"""

from __future__ import annotations

import pytest

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
