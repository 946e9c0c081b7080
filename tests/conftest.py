"""A skipped multi-rank test is a failure: a harness that skips them on a CPU machine proves nothing."""

from __future__ import annotations

import pytest

_skipped_multirank: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multirank: launches several real ranks; skipping it fails the suite")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "multirank" in report.keywords:
        _skipped_multirank.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_multirank:
        print(f"\nmulti-rank tests were skipped, which counts as failure: {_skipped_multirank}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
