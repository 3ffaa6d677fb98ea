"""A bounded background writer: prefix-unit and window-snapshot writes (fsync, Redis) off the engine thread.

Key idea: the engine thread only captures what must be captured while the sequence is alive (a copy of the
rows, the ring state) and hands a write job to one worker thread through a bounded queue. A full queue drops the
job (logged once, counted): a slow disk or a hung Redis then costs lost cache entries, never a decode step.
Jobs run in submission order, so a unit's parent is written (or has failed) before the unit itself; the store
refuses a unit whose parent is missing, so a dropped or failed parent never leaves a stranded child (SPEC §6).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class BackgroundWriter:
    """One daemon thread running `submit`ted jobs in order; at most `max_jobs` / `max_bytes` pending."""

    def __init__(self, max_jobs: int = 256, max_bytes: int = 1 << 30, name: str = "dsv41-prefix-writer"):
        if max_jobs < 1 or max_bytes < 1:
            raise ValueError(f"max_jobs ({max_jobs}) and max_bytes ({max_bytes}) must be >= 1")
        self.max_jobs, self.max_bytes = max_jobs, max_bytes
        self._jobs: deque[tuple[Callable[[], object], int]] = deque()
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self._cond = threading.Condition()
        self._warned = False
        self.counters = dict(submitted=0, done=0, dropped=0, failed=0)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], object], nbytes: int = 0) -> bool:
        """Queue `job`; False (dropped, nothing blocks) when the queue is full or the writer is closed."""
        with self._cond:
            full = len(self._jobs) >= self.max_jobs or (self._jobs and self._pending_bytes + nbytes > self.max_bytes)
            if self._closed or full:
                self.counters["dropped"] += 1
                first, self._warned = not self._warned, True
            else:
                self._jobs.append((job, nbytes))
                self._pending_bytes += nbytes
                self.counters["submitted"] += 1
                self._cond.notify()
                return True
        log.log(logging.WARNING if first else logging.DEBUG,
                "prefix writer: queue full or closed (%d jobs pending); a cache write was skipped", len(self._jobs))
        return False

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job has run; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Run what is queued (up to `timeout`), then stop; jobs still queued after it are dropped."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self.counters["dropped"] += len(self._jobs)
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(0 if not done else timeout)
        return done

    def pending(self) -> int:
        with self._cond:
            return len(self._jobs) + self._busy

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, nbytes = self._jobs.popleft()
                self._busy = True
            try:
                job()
                ok = "done"
            except Exception:  # noqa: BLE001 - a failed cache write is skipped, never fatal
                log.exception("prefix writer: a cache write failed; skipped")
                ok = "failed"
            with self._cond:
                self._busy = False
                self._pending_bytes -= nbytes
                self.counters[ok] += 1
                self._cond.notify_all()
