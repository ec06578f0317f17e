"""The `process` marker's scan (tests/process_scan.py) on small examples, and the fast tier's guard."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from process_scan import FORBID_PROCESSES_ENV, ROOT, ProcessScan, forbid_processes, item_roots

# Source text, not functions of this file: a test naming a starting helper is marked `process` itself,
# and these tests belong in the fast tier. Compiled under this file's name, the examples count as the
# repository's own code, which the scan reads.
EXAMPLES = '''
import functools
import os
import subprocess

import torch
from dist_harness import run_distributed


def _body(*args: object) -> int:
    return 1


def _run_on_two_ranks() -> list:
    return run_distributed(_body, 2)


def _prepare() -> list:
    return _run_on_two_ranks()


@functools.cache
def _compiled() -> object:
    return subprocess.run(["true"], check=True)


def calls_run_distributed_two_helpers_down() -> None:
    _prepare()


def uses_subprocess() -> None:
    subprocess.run(["true"], check=True)


def imports_run_distributed_inside() -> None:
    from dist_harness import run_distributed as run
    run(_body, 2)


def forks_in_a_lambda() -> object:
    return lambda: os.fork()


def spawns_with_torch() -> None:
    torch.multiprocessing.spawn(_body, nprocs=2)


def uses_a_cached_builder() -> object:
    return _compiled()


def pure() -> int:
    return sum(range(4)) + _body() + len(os.environ.get("HOME", ""))


def reads_environment_only() -> str:
    return os.path.join(os.getcwd(), "x")
'''


@pytest.fixture(scope="module")
def examples() -> dict[str, Any]:
    """The examples' module namespace."""
    namespace: dict[str, Any] = {"__name__": "process_scan_examples"}
    exec(compile(EXAMPLES, __file__, "exec"), namespace)
    return namespace


@pytest.mark.parametrize(("name", "starts"), [
    ("calls_run_distributed_two_helpers_down", True),
    ("uses_subprocess", True),
    ("imports_run_distributed_inside", True),
    ("forks_in_a_lambda", True),
    ("spawns_with_torch", True),
    ("uses_a_cached_builder", True),
    ("pure", False),
    ("reads_environment_only", False),
])
def test_scan_finds_process_starters_through_helpers(examples: dict[str, Any], name: str, starts: bool) -> None:
    assert ProcessScan().starts_process(examples[name]) is starts


def test_a_starting_fixture_marks_a_pure_test(examples: dict[str, Any]) -> None:
    scan = ProcessScan()
    assert not scan.starts_process(examples["pure"])
    assert scan.starts_process(examples["pure"], examples["uses_subprocess"])


def test_one_scan_answers_alike_in_any_order(examples: dict[str, Any]) -> None:
    # The scan remembers what it learnt across tests; a later question must not get a stale answer.
    names = ["pure", "calls_run_distributed_two_helpers_down", "reads_environment_only", "_prepare", "_body"]
    expected = {name: ProcessScan().starts_process(examples[name]) for name in names}
    scan = ProcessScan()
    assert {name: scan.starts_process(examples[name]) for name in reversed(names)} == expected


@pytest.fixture
def answer() -> int:
    """A fixture for the test below to be judged by."""
    return 42


@pytest.mark.parametrize("value", [float])
def test_a_test_is_judged_by_its_function_fixtures_and_parameters(request: pytest.FixtureRequest, answer: int,
                                                                 value: type) -> None:
    roots = item_roots(request.node)
    assert roots[0] is request.node.function and value in roots
    assert "answer" in {getattr(r, "__name__", None) for r in roots}
    assert request.node.get_closest_marker("process") is None, "this file's tests run in the fast tier"


def test_the_guard_refuses_every_way_to_start_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_processes(monkeypatch)
    with pytest.raises(RuntimeError, match="BMT_TESTS_FORBID_PROCESSES"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(RuntimeError, match="BMT_TESTS_FORBID_PROCESSES"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(RuntimeError, match="BMT_TESTS_FORBID_PROCESSES"):
        os.fork()


def test_the_scan_still_sees_the_starters_the_guard_replaced(examples: dict[str, Any],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # `make test-fast` collects under the guard: its tiers must be those `make test` sees.
    forbid_processes(monkeypatch)
    assert ProcessScan().starts_process(examples["forks_in_a_lambda"])


def test_a_fresh_font_cache_does_not_fail_the_fast_tier(tmp_path: Path) -> None:
    # Lightning imports matplotlib (through torchmetrics), whose first import on a fresh machine runs fc-list
    # to build its font cache: conftest must let it run before the guard goes on, not inside the test.
    env = {**os.environ, FORBID_PROCESSES_ENV: "1", "MPLCONFIGDIR": str(tmp_path / "matplotlib")}
    test = "tests/test_checkpoint_sharded.py::test_a_missing_directory_is_named"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not process", test],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "1 passed" in run.stdout
