"""The watchdog behind stream-ordered GPU waits: it must name an op that misses its deadline, or a
backend error, within a poll or two, once, and stay quiet while ops finish in time.

It runs on CPU here with real threads and ``threading.Event``s standing for CUDA events (the GPU backend
passes ``torch.cuda.Event.query``); the GPU backend itself is exercised by the GPU tests.
"""

from __future__ import annotations

import threading
import time

from bmt_wrap.runtime.comm.watchdog import CompletionWatchdog


def _recorder() -> tuple[list[tuple[str, str]], threading.Event, object]:
    failures: list[tuple[str, str]] = []
    fired = threading.Event()

    def on_failure(what: str, why: str) -> None:
        failures.append((what, why))
        fired.set()

    return failures, fired, on_failure


def test_ops_finishing_in_time_raise_nothing() -> None:
    failures, fired, on_failure = _recorder()
    dog = CompletionWatchdog(on_failure, poll_s=0.01)
    events = [threading.Event() for _ in range(5)]
    for i, e in enumerate(events):
        dog.watch(e.is_set, time.monotonic() + 5, f"op {i}")
    for e in events:
        e.set()
    deadline = time.monotonic() + 5
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.pending() == 0 and not fired.is_set() and not dog.failed
    dog.close()


def test_an_op_past_its_deadline_is_named_once_behind_finished_ones() -> None:
    failures, fired, on_failure = _recorder()
    dog = CompletionWatchdog(on_failure, poll_s=0.01)
    finished, stuck = threading.Event(), threading.Event()
    finished.set()
    start = time.monotonic()
    dog.watch(finished.is_set, start + 0.05, "all_gather_into layers.0")
    dog.watch(stuck.is_set, start + 0.2, "all_gather_into layers.1")
    dog.watch(stuck.is_set, start + 0.2, "reduce_scatter_into layers.1")
    assert fired.wait(5), "the stuck op was never reported"
    took = time.monotonic() - start
    time.sleep(0.1)
    assert failures == [("all_gather_into layers.1", "timeout")], failures
    assert 0.2 <= took < 2.0 and dog.failed


def test_a_backend_error_is_reported_even_before_any_deadline() -> None:
    failures, fired, on_failure = _recorder()
    broken = threading.Event()

    def probe() -> None:
        if broken.is_set():
            raise RuntimeError("NCCL error: remote process exited")

    dog = CompletionWatchdog(on_failure, probe=probe, poll_s=0.01)
    never = threading.Event()
    dog.watch(never.is_set, time.monotonic() + 3600, "all_reduce sum_loss")
    time.sleep(0.05)
    assert not fired.is_set()
    broken.set()
    assert fired.wait(5)
    assert failures == [("all_reduce sum_loss", "asynchronous error: NCCL error: remote process exited")]
