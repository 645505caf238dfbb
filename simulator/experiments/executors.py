"""Where points run: inline, in local worker processes, or on a Ray cluster.

One interface, so that a fixed grid (sweep) and an adaptive search (plan) drive them alike::

    with open_executor("local", jobs=4) as ex:
        ex.submit(tag, fn, *args)                 # any time, also while iterating below
        for tag, outcome in ex.as_completed():    # until nothing is pending
            ...                                   # outcome.value, or outcome.error (one line)

``fn`` runs in the worker; an exception there comes back as ``Outcome.error`` (one line) with
``Outcome.user_error`` telling a :class:`ServesimError` (a config the engine refuses) from a
crash. Records are written by the caller, in the driver process: with Ray, results stream back
from the cluster to the driver's output folder.

Shutdown. Leaving the ``with`` block normally stops idle workers; leaving it by an exception
(Ctrl-C is a ``KeyboardInterrupt``) cancels what is pending and kills running workers at once.
Local workers ignore SIGINT (the terminal sends it to the whole process group: the driver
decides) and watch their parent: if the driver dies without clean-up (SIGKILL, the OOM killer)
each worker exits within ``WATCH_PARENT_S`` seconds, so no orphan keeps simulating.

Backends: ``inline`` (jobs = 1: in the driver, one point at a time, lazily, so each point is
written before the next starts), ``local`` (loky worker processes), ``ray`` (``ray_address``,
else ``RAY_ADDRESS``, else a local Ray started with ``num_cpus = jobs`` and shut down after).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Self

from servesim.simulator.errors import ConfigError, ServesimError
from servesim.simulator.experiments.points import one_line

BACKENDS = ("local", "ray")
WATCH_PARENT_S = 0.25


@dataclass(frozen=True)
class Outcome:
    """What a point's function gave: its value, or a one-line error; and its warnings."""

    value: Any = None
    error: str | None = None
    kind: str = ""  # the exception's class name
    user_error: bool = False  # the error is a ServesimError (bad config), not a crash
    warnings: tuple[tuple[type[Warning], str], ...] = ()  # (category, message)


def call(fn: Callable, args: tuple) -> Outcome:
    """Run ``fn(*args)`` in a worker; an exception becomes an :class:`Outcome` error and the
    warnings it raises travel back with it (the driver shows each distinct one once, whatever
    process or node the point ran on)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = Outcome(fn(*args))
        except Exception as e:  # noqa: BLE001 -- reported to the driver, which decides
            out = Outcome(error=one_line(e), kind=type(e).__name__,
                          user_error=isinstance(e, ServesimError))
    seen = tuple(dict.fromkeys((w.category, str(w.message)) for w in caught))
    return replace(out, warnings=seen) if seen else out


def _watch_parent(ppid: int) -> None:
    while os.getppid() == ppid:
        time.sleep(WATCH_PARENT_S)
    os._exit(1)  # the driver is gone: nobody will read this worker's result


def worker_init() -> None:
    """Initializer of local worker processes (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True,
                     name="servesim-watch-parent").start()


class Executor:
    """``submit(tag, fn, *args)`` and ``as_completed()``; a context manager (see above)."""

    def submit(self, tag: Any, fn: Callable, *args: Any) -> None:
        raise NotImplementedError

    def as_completed(self) -> Iterator[tuple[Any, Outcome]]:
        raise NotImplementedError

    @property
    def pending(self) -> int:
        raise NotImplementedError

    def close(self, *, kill: bool) -> None:
        """Stop the workers; ``kill``: at once, dropping unfinished points."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(kill=exc_type is not None)


class InlineExecutor(Executor):
    """Runs each point in the driver when ``as_completed`` reaches it (submission order)."""

    def __init__(self) -> None:
        self._queue: deque = deque()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, tag: Any, fn: Callable, *args: Any) -> None:
        self._queue.append((tag, fn, args))

    def as_completed(self) -> Iterator[tuple[Any, Outcome]]:
        while self._queue:
            tag, fn, args = self._queue.popleft()
            yield tag, call(fn, args)


class ProcessExecutor(Executor):
    """Local worker processes (loky: spawned, reused across points, killable). At most
    ``jobs`` points are handed to the pool at a time; the rest wait here, so an interrupt has
    nothing queued inside the pool to unwind."""

    def __init__(self, jobs: int) -> None:
        from joblib.externals.loky import ProcessPoolExecutor

        self.jobs = jobs
        self._ex = ProcessPoolExecutor(max_workers=jobs, initializer=worker_init)
        self._futures: dict[Any, Any] = {}
        self._backlog: deque = deque()

    @property
    def pending(self) -> int:
        return len(self._futures) + len(self._backlog)

    def submit(self, tag: Any, fn: Callable, *args: Any) -> None:
        self._backlog.append((tag, fn, args))
        self._fill()

    def _fill(self) -> None:
        while self._backlog and len(self._futures) < self.jobs:
            tag, fn, args = self._backlog.popleft()
            self._futures[self._ex.submit(call, fn, args)] = tag

    def as_completed(self) -> Iterator[tuple[Any, Outcome]]:
        from concurrent.futures import FIRST_COMPLETED, wait

        while self._futures:
            done, _ = wait(list(self._futures), return_when=FIRST_COMPLETED)
            for fut in done:
                tag = self._futures.pop(fut)
                self._fill()
                try:
                    out = fut.result()
                except Exception as e:  # noqa: BLE001 -- the worker process died
                    out = Outcome(error=f"worker process failed: {one_line(e)}")
                yield tag, out

    def close(self, *, kill: bool) -> None:
        self._backlog.clear()
        if kill:
            self._drain_work_ids()
        # loky fails the pending futures itself; killing is quick, so wait for it
        self._ex.shutdown(wait=True, kill_workers=kill)
        self._futures.clear()

    def _drain_work_ids(self) -> None:
        """Take back the points submitted but not yet on their way to a worker, as the
        standard library's executor does on ``shutdown(cancel_futures=True)``. loky (joblib
        1.6) cancels them on ``kill_workers`` but leaves their ids queued: its manager thread
        then dies on a ``KeyError`` (a traceback on the user's terminal after Ctrl-C) without
        closing its queues (the resource tracker's "leaked semlock" warnings). Only this
        thread submits, so nothing can be queued after the drain."""
        import queue

        ids = getattr(self._ex, "_work_ids", None)
        while ids is not None:
            try:
                ids.get_nowait()
            except queue.Empty:
                return


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``host:port`` (or ``ray://host:port``) Ray address must accept a TCP connection
    within ``timeout_s``: ``ray.init`` itself retries an unreachable one for minutes.
    Other forms (``auto``, ``local``) are left to Ray."""
    import socket

    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ServesimError(f"--backend ray: cannot connect to Ray at {address} "
                            f"({getattr(e, 'strerror', None) or e})") from None


class RayExecutor(Executor):
    """Points as Ray tasks (1 CPU each) on the cluster at ``address``, or on a local Ray."""

    def __init__(self, jobs: int, address: str | None) -> None:
        try:
            import ray
        except ImportError:
            raise ServesimError("--backend ray: ray is not installed "
                                "(pip install 'servesim[cluster]')") from None
        self.ray = ray
        self.started = not ray.is_initialized()
        address = address or os.environ.get("RAY_ADDRESS") or None
        if self.started:
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": "warning"}
            try:
                if address:
                    _check_reachable(address)
                    ray.init(address=address, **kw)
                else:
                    ray.init(num_cpus=jobs, **kw)
            except Exception as e:  # noqa: BLE001 -- any start-up failure is a user error
                where = f"connect to Ray at {address}" if address else "start a local Ray"
                raise ServesimError(f"--backend ray: cannot {where} ({one_line(e)})") from None
        self._call = ray.remote(num_cpus=1, max_retries=0)(call)
        self._refs: dict[Any, Any] = {}

    @property
    def pending(self) -> int:
        return len(self._refs)

    def submit(self, tag: Any, fn: Callable, *args: Any) -> None:
        self._refs[self._call.remote(fn, args)] = tag

    def as_completed(self) -> Iterator[tuple[Any, Outcome]]:
        while self._refs:
            done, _ = self.ray.wait(list(self._refs), num_returns=1)
            for ref in done:
                tag = self._refs.pop(ref)
                try:
                    out = self.ray.get(ref)
                except Exception as e:  # noqa: BLE001 -- the worker or its node died
                    out = Outcome(error=f"ray worker failed: {one_line(e)}")
                yield tag, out

    def close(self, *, kill: bool) -> None:
        if kill:
            for ref in self._refs:
                try:
                    self.ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001,S110 -- already finished or gone
                    pass
        self._refs.clear()
        if self.started:
            self.ray.shutdown()


def check_options(backend: str, jobs: int | None) -> int:
    """Validate ``--backend`` / ``--jobs``; return the job count (default: the cores)."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend}: expected local or ray")
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs {jobs}: expected a positive integer")
    return jobs or os.cpu_count() or 1


def open_executor(backend: str = "local", jobs: int | None = None,
                  ray_address: str | None = None) -> Executor:
    """The executor for ``--backend``/``--jobs``/``--ray-address`` (see the module docstring)."""
    jobs = check_options(backend, jobs)
    if backend == "ray":
        return RayExecutor(jobs, ray_address)
    return InlineExecutor() if jobs == 1 else ProcessExecutor(jobs)
