"""A skipped multi-rank test is a failure: a harness that skips them on a CPU machine proves nothing.

Tiers: a test that starts processes (torchrun ranks, a subprocess) or runs a whole script (``run_ranks`` on one rank
runs it in the test's process, ``launch.run_here``), itself, through a fixture or through a helper of its module, is
marked ``slow`` at collection. ``make test`` runs every test (CI);
``make test-fast`` runs ``-m "not slow"``: the in-process tests a developer runs after each change.
"""

from __future__ import annotations

import collections
import functools
import inspect
import re
import sys
import types

import pytest

SPAWNS = re.compile(r"\b(run_ranks|subprocess\.(run|Popen|check_output|check_call|call)|torchrun|os\.fork)\b")
"""What starts a process in a test's source."""


@functools.cache
def _spawning_helpers(module: types.ModuleType) -> frozenset[str]:
    """Names of the module's own functions and classes that start processes, directly or through another such."""
    sources = {}
    for name, value in vars(module).items():
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__:
            try:
                sources[name] = inspect.getsource(value)
            except (OSError, TypeError):
                continue
    found = {name for name, source in sources.items() if SPAWNS.search(source)}
    while True:
        more = {name for name, source in sources.items() if name not in found
                and any(re.search(rf"\b{re.escape(other)}\(", source) for other in found)}
        if not more:
            return frozenset(found)
        found |= more


def _spawns(function: object) -> bool:
    function = inspect.unwrap(function)
    module = inspect.getmodule(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return bool(SPAWNS.search(source)) or (module is not None and any(
        re.search(rf"\b{re.escape(name)}\(", source) for name in _spawning_helpers(module)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        functions = [getattr(item, "function", None), *(defs[-1].func for defs in fixtures.values() if defs)]
        if "multirank" in item.keywords or any(f is not None and _spawns(f) for f in functions):
            item.add_marker(pytest.mark.slow)
    # The files with the most such tests first (sort is stable: a file's tests keep their order). make test's two
    # workers take whole files in this order, so the long ones start at once and the run does not end with one
    # worker finishing a long file alone while the other waits.
    slow = collections.Counter(item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])

_skipped_multirank: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multirank: launches several real ranks; skipping it fails the suite")
    # registered here, not in pyproject.toml: the Makefile rebuilds .venv whenever pyproject.toml changes
    config.addinivalue_line("markers", "slow: starts processes (ranks, the CLI, a script); not in make test-fast")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "multirank" in report.keywords:
        _skipped_multirank.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    launch = sys.modules.get("launch")
    if launch is not None:  # the ranks kept for this process's several-rank launches end with it
        launch.KeptRanks.close_all()
    if _skipped_multirank:
        print(f"\nmulti-rank tests were skipped, which counts as failure: {_skipped_multirank}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
