"""Progress of long phases: the code doing the work reports, the CLI shows it.

``with phase("simulating", total) as tick: ... tick(done)`` costs one function call per tick
when nobody listens. The ``simulate`` CLI installs :class:`BarReporter`, which draws a rich
progress bar on stderr for every phase still running after :data:`SHOW_AFTER_S` seconds
(when stderr is a terminal; none under ``--quiet``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SHOW_AFTER_S = 2.0
_reporter = None  # object with start(name, total) -> (tick, stop), or None


def set_reporter(reporter) -> object:
    """Install ``reporter`` (None: silence); returns the previous one."""
    global _reporter
    old, _reporter = _reporter, reporter
    return old


def _noop(done: int = 0) -> None:
    return None


@contextmanager
def phase(name: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """A named phase; yields ``tick(done)`` to report how many of ``total`` units are done."""
    if _reporter is None:
        yield _noop
        return
    tick, stop = _reporter.start(name, total)
    try:
        yield tick
    finally:
        stop()


class BarReporter:
    """Transient rich bars on stderr (one live display shared by nested phases), each shown
    once its phase has run for ``show_after_s``."""

    def __init__(self, show_after_s: float = SHOW_AFTER_S):
        self.show_after_s = show_after_s
        self._lock = threading.Lock()
        self._bar = None
        self._active = 0

    def _progress(self):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        if self._bar is None:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                                 transient=True, console=Console(stderr=True))
            self._bar.start()
        return self._bar

    @staticmethod
    def _count(done: int, total: int | None) -> str:
        return f"{done:,}/{total:,}" if total else (f"{done:,}" if done else "")

    def start(self, name: str, total: int | None):
        state = {"task": None, "last": 0.0, "done": 0, "stopped": False}

        def show() -> None:
            with self._lock:
                if state["stopped"]:
                    return
                bar = self._progress()
                state["task"] = bar.add_task(name, total=total or None,
                                             completed=state["done"],
                                             count=self._count(state["done"], total))
                self._active += 1

        timer = threading.Timer(self.show_after_s, show)
        timer.daemon = True
        timer.start()

        def tick(done: int = 0) -> None:
            state["done"] = done
            now = time.perf_counter()
            if state["task"] is None or now - state["last"] < 0.2:
                return
            state["last"] = now
            self._bar.update(state["task"], completed=done, count=self._count(done, total))

        def stop() -> None:
            timer.cancel()
            with self._lock:
                state["stopped"] = True
                if state["task"] is None:
                    return
                self._bar.remove_task(state["task"])
                self._active -= 1
                if not self._active:
                    self._bar.stop()
                    self._bar = None

        return tick, stop
