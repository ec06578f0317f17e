"""Shared pytest set-up: persistent multi-rank worker groups, hypothesis profiles, the `process` marker."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from dist_harness import STARTS, shutdown_all
from hypothesis import settings
from process_scan import FORBID_PROCESSES_ENV, ProcessScan, forbid_processes, item_roots, warm_import_helpers

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Multi-rank property tests run few, reproducible examples; deadlines are meaningless on a loaded box.
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=25, print_blob=True)
settings.load_profile("ci")


def pytest_configure(config: pytest.Config) -> None:
    """Under `make test-fast`, make any process a test starts fail it (see process_scan.forbid_processes)."""
    # A process started anyway means the scan missed one: that must fail loudly, not quietly slow the
    # inner loop down or hang it on a worker group.
    # Under pytest-xdist the controller starts the workers and runs no test: the guard goes in each worker.
    controller = bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")
    if os.environ.get(FORBID_PROCESSES_ENV) == "1" and not controller:
        # A library that starts a helper on its first import (matplotlib's font cache, on a fresh machine)
        # does so here, before the guard: the guard is for the processes tests start.
        warm_import_helpers()
        patch = pytest.MonkeyPatch()
        forbid_processes(patch)
        config.add_cleanup(patch.undo)
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerStarts(), "bmt-worker-starts")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test that starts a process `process`, from its code (tests/process_scan.py)."""
    scan = ProcessScan()
    for item in items:
        if isinstance(item, pytest.Function) and scan.starts_process(*item_roots(item)):
            item.add_marker(pytest.mark.process)


# The world sizes most files use. An idle worker still costs CPU (gloo wakes a thread per process group it
# built, and a worker keeps every layout's groups: an idle 8-rank group took 22% of a core), so a group of
# another size (8 ranks for test_mesh3d, 3 for test_whole_matrix_optim) stops when its file ends.
KEPT_WORLD_SIZES = (1, 2, 4)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """At a test file's end, stop the worker groups of sizes few files use."""
    if nextitem is None or nextitem.path != item.path:
        shutdown_all(keep=KEPT_WORLD_SIZES)


# Seconds (set-up, call and tear-down) and tests per test file: every run, CI's included, says where its
# time went (docs/design.md "Testing: where the time goes").
FILE_SECONDS: Counter[str] = Counter()
FILE_TESTS: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add a test phase's duration to its file's."""
    path = report.nodeid.split("::")[0]
    FILE_SECONDS[path] += report.duration
    FILE_TESTS[path] += report.when == "call"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutdown_all()
    # Under pytest-xdist (`make test` runs two pytest workers), each worker starts its own worker groups:
    # it hands their list to the controller, which prints them with its own.
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["bmt_starts"] = list(STARTS)


class _WorkerStarts:
    """On the xdist controller: collect each pytest worker's worker-group starts for the summary."""

    @pytest.hookimpl
    def pytest_testnodedown(self, node: object, error: object) -> None:
        STARTS.extend(tuple(start) for start in getattr(node, "workeroutput", {}).get("bmt_starts", ()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where the time went, by file; how many worker groups the session started, and what they cost (a
    failed body rebuilds its group)."""
    if len(FILE_SECONDS) > 1:
        top = FILE_SECONDS.most_common(20)
        terminalreporter.write_sep("-", f"seconds by test file, the {len(top)} slowest of {len(FILE_SECONDS)} "
                                        f"({sum(FILE_SECONDS.values()):.0f} s in all)")
        for path, seconds in top:
            terminalreporter.write_line(f"{seconds:7.1f} s  {FILE_TESTS[path]:4d} tests  {path}")
    if not STARTS:
        return
    total = sum(seconds for _, seconds, _ in STARTS)
    terminalreporter.write_sep("-", f"{len(STARTS)} worker group starts, {total:.0f} s")
    for size, seconds, test in STARTS:
        terminalreporter.write_line(f"{seconds:6.1f} s  world size {size}  for {test}")
