"""A background watch over work queued on a GPU stream, so waits can be stream-ordered.

A stream-ordered wait (the compute stream waits on the collective's event, as FSDP2 does) never blocks
the host, so the host can no longer notice a collective that never finishes. This thread does: it polls
the oldest unfinished op (ops on one stream finish in order) and a health probe (NCCL's asynchronous
error), and when an op passes its deadline or the probe fails it calls ``on_failure`` once, which
aborts the communicator (releasing the stuck stream) and makes the next call on the main thread raise.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable


class CompletionWatchdog:
    """Watches ``done()`` callables in FIFO order against their deadlines from one daemon thread."""

    def __init__(self, on_failure: Callable[[str, str], None], probe: Callable[[], None] | None = None,
                 poll_s: float = 0.05) -> None:
        self._on_failure = on_failure  # (what, why): called once, from the watchdog thread
        self._probe = probe  # raises when the backend reports an asynchronous error
        self._poll_s = poll_s
        self._pending: collections.deque[tuple[Callable[[], bool], float, str]] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self.failed = False
        self._thread = threading.Thread(target=self._run, name="bmt_wrap-watchdog", daemon=True)
        self._thread.start()

    def watch(self, done: Callable[[], bool], deadline: float, what: str) -> None:
        """Fail unless ``done()`` is true by ``deadline`` (``time.monotonic()`` seconds)."""
        with self._cond:
            self._pending.append((done, deadline, what))
            self._cond.notify()

    def pending(self) -> int:
        """Ops watched and not yet seen finished."""
        with self._cond:
            return len(self._pending)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (pending ops are no longer watched)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                done, deadline, what = self._pending[0]
            why = self._probe_error()
            if why is None and done():
                with self._cond:
                    self._pending.popleft()  # only this thread removes entries
                continue
            if why is None and time.monotonic() > deadline:
                why = "timeout"
            if why is not None:
                self.failed = True
                self._on_failure(what, why)
                return
            with self._cond:
                self._cond.wait(self._poll_s)

    def _probe_error(self) -> str | None:
        """The backend's asynchronous error, if the probe reports one."""
        if self._probe is not None:
            try:
                self._probe()
            except Exception as exc:  # whatever type the backend raises
                return f"asynchronous error: {exc}"
        return None
