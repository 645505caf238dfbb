"""One experiment run: an executor, a point store, a progress bar and what Ctrl-C keeps.

A sweep submits its whole grid at once; a plan submits the next probe of a search when the
previous one comes back. Both go through :class:`ExperimentRun`::

    with ExperimentRun(store, label="sweep ab", total=45, backend="local", jobs=4) as run:
        for p in points:
            if run.load(p, h) is None:            # resume: a record of this definition exists
                run.submit(p, fn, *args)
        for p, outcome in run.as_completed():
            run.save(p, record)                   # atomic; counted as kept

A ``KeyboardInterrupt`` inside the block kills the workers and leaves as :class:`Interrupted`,
which says how many points are kept on disk (``--resume`` starts from there).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

from servesim.simulator.experiments.executors import Executor, Outcome, open_executor
from servesim.simulator.experiments.points import Point
from servesim.simulator.experiments.store import PointStore


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """A SIGINT arriving inside the block takes effect (the handler that was installed runs)
    when the block ends (main thread only: elsewhere handlers cannot be swapped)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = signal.signal(signal.SIGINT, lambda sig, frame: caught.append(sig))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if caught and callable(old):
        old(signal.SIGINT, None)
    elif caught and old == signal.SIG_DFL:
        raise KeyboardInterrupt


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during an experiment; ``kept`` points (of ``total``, when known) are in ``folder``."""

    def __init__(self, kept: int, total: int | None, folder: Path):
        super().__init__(f"{kept} point(s) kept in {folder}")
        self.kept, self.total, self.folder = kept, total, folder

    def describe(self, resume_command: str) -> str:
        """The one line the CLI prints, e.g. ``interrupted: 12 of 45 points kept in out/ab;
        resume with: simulate sweep ab.yaml -o out --resume``."""
        of = f" of {self.total}" if self.total is not None else ""
        return (f"interrupted: {self.kept}{of} point(s) kept in {self.folder}; "
                f"resume with: {resume_command}")


class ExperimentRun:
    """Executor + store + progress for one sweep or plan (see the module docstring)."""

    def __init__(self, store: PointStore, *, label: str, total: int | None = None,
                 kept: int = 0, backend: str = "local", jobs: int | None = None,
                 ray_address: str | None = None, resume: bool = False, progress: bool = False):
        self.store = store
        self.resume = resume
        self.total = total
        self.kept = kept  # records on disk for this experiment: reused + written
        self._open = lambda: open_executor(backend, jobs, ray_address)
        self._ex: Executor | None = None
        self._bar_args = (label, total, kept) if progress else None
        self._bar: _Bar | None = None
        self._warned: set[tuple[type[Warning], str]] = set()

    def __enter__(self) -> Self:
        self._ex = self._open()
        if self._bar_args is not None:
            self._bar = _Bar(*self._bar_args)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.stop()
        assert self._ex is not None
        self._ex.__exit__(exc_type, exc, tb)
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and not isinstance(
                exc, Interrupted):
            raise Interrupted(self.kept, self.total, self.store.root) from None

    def load(self, p: Point, expect_hash: str) -> dict | None:
        """On ``--resume``: ``p``'s stored record when it was written for this definition."""
        rec = self.store.load(p, expect_hash) if self.resume else None
        if rec is not None:
            self.kept += 1
            self.progress()
        return rec

    def submit(self, tag: Any, fn: Callable, *args: Any) -> None:
        assert self._ex is not None, "submit inside the with block"
        self._ex.submit(tag, fn, *args)

    @property
    def pending(self) -> int:
        return self._ex.pending if self._ex is not None else 0

    def as_completed(self) -> Iterator[tuple[Any, Outcome]]:
        """Finished points, in completion order; their warnings are shown here, once each."""
        assert self._ex is not None
        for tag, out in self._ex.as_completed():
            for category, message in out.warnings:
                if (category, message) not in self._warned:
                    self._warned.add((category, message))
                    warnings.warn(message, category, stacklevel=2)
            yield tag, out

    def save(self, p: Point, record: dict) -> None:
        """Write ``p``'s record and count it as kept, with Ctrl-C held back in between: the
        count an interruption reports is then the count on disk."""
        with _ctrl_c_deferred():
            self.store.save(p, record)
            self.kept += 1
        self.progress()

    def save_failure(self, p: Point, record: dict) -> Path:
        path = self.store.save_failure(p, record)
        self.progress()
        return path

    def progress(self, done: int | None = None, total: int | None = None) -> None:
        """Advance the bar by one point, or set it (an adaptive search re-estimates its total)."""
        if self._bar is not None:
            self._bar.update(done, total)


class _Bar:
    def __init__(self, label: str, total: int | None, done: int):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.p = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                          console=Console(stderr=True), transient=False)
        self.p.start()
        self.task = self.p.add_task(label, total=total, completed=done)

    def update(self, done: int | None, total: int | None) -> None:
        if done is None:
            self.p.advance(self.task)
        else:
            self.p.update(self.task, completed=done, total=total)

    def stop(self) -> None:
        self.p.stop()
