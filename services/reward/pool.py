"""Worker processes that run calls under a per-call deadline and abandon the ones that hang.

Why processes, and why this design:

- A Python thread cannot be stopped, and `signal.alarm` (math-verify's own mechanism) only works
  in the main thread, with whole-second resolution, and not inside C code that holds the GIL. The
  only reliable way to abandon a hung check is to run it in another process and kill that.
- `concurrent.futures.ProcessPoolExecutor` cannot kill one running task: `Future.cancel` does not
  stop a running call and `shutdown` waits for (or leaks) the hung worker. So the pool here keeps
  its own workers, each a separate process with a private socket pair and at most one call in
  flight.
- Each call's deadline starts when it is handed to a ready worker, so time spent starting a
  worker (importing sympy takes seconds) is never charged to the call. When a deadline passes,
  that one worker is killed with SIGKILL (a sleeping or looping check cannot resist it), the call
  ends as `TimedOut`, and a fresh worker is started in its place; the other workers keep going.
  A worker that dies in a call (segfault, `os._exit`, the OOM killer) ends that call as
  `Raised("WorkerCrashed: ...")` and is replaced the same way. An exception inside a call is
  caught in the worker and returned as `Raised("ExcType: message")`; the worker lives on.
- Workers are fresh interpreters (`subprocess.Popen` of `sys.executable`), not `fork`ed: the
  pool usually lives in a Ray actor, a multi-threaded process, and a forked child of one can
  inherit locks held by other threads and deadlock. Not `multiprocessing`'s `spawn` either: it
  re-runs the parent's `__main__` in every child, which breaks scripts without a main guard and
  makes each worker in a Ray actor import Ray. A worker receives the parent's `sys.path` and then
  the pickled target over its pipe; unpickling imports the target's module, and only then does
  the worker report ready.
- A worker exits when its pipe closes (the pool went away) or, if it is stuck in a call, when its
  parent dies (a watchdog thread notices the changed parent pid), so no orphan keeps burning CPU.

A pool is not thread-safe: one `run` at a time (a Ray actor runs one method at a time by default).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Generic, TypeVar

T = TypeVar("T")

_READY = "ready"
_STARTUP_FAILED = "startup failed"
_MAX_ERROR_CHARS = 500  # an exception message can embed a whole response; keep reports small


@dataclass(frozen=True)
class Done(Generic[T]):
    """The call returned `value`."""

    value: T


@dataclass(frozen=True)
class TimedOut:
    """The call was still running at its deadline; its worker was killed."""


@dataclass(frozen=True)
class Raised:
    """The call raised, or its worker died; `error` is `"ExceptionType: message"`."""

    error: str


Outcome = Done[T] | TimedOut | Raised


class WorkerStartupError(RuntimeError):
    """A worker process died or hung before it was ready (e.g. the target does not import)."""


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process soon after its parent dies, even while the main thread is stuck."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


# Run by each worker interpreter: takes sys.path first, so that the rest can be imported.
_BOOTSTRAP = f"""\
import sys
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
sys.path[:] = conn.recv()
from {__name__} import serve
serve(conn)
"""


def serve(conn: Connection) -> None:
    """Main loop of a worker process: receive the target, then run calls until told to stop."""
    _exit_with_parent()
    try:
        target = conn.recv()
    except Exception as exc:
        # Typically the target's module does not import here; tell the pool why.
        conn.send((_STARTUP_FAILED, _describe(exc)))
        return
    conn.send(_READY)
    while True:
        try:
            message = conn.recv()
        except (EOFError, ConnectionError):
            return  # the pool closed its end, or its process died (a reset, not a clean EOF)
        if message is None:
            return
        task_id, args = message
        try:
            reply: tuple[int, bool, object] = (task_id, True, target(*args))
        except Exception as exc:
            reply = (task_id, False, _describe(exc))
        try:
            conn.send(reply)
        except ConnectionError:
            return  # the pool is gone; nobody is left to answer
        except Exception as exc:
            # The result did not pickle; `send` pickles before writing, so the pipe is intact.
            conn.send((task_id, False, _describe(exc)))


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


class _Worker:
    """One worker process, its pipe, and the call it is running, as seen from the pool."""

    def __init__(self, target: Callable[..., object]) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        # Kill it if the pool is dropped without close(), or at interpreter exit.
        self._finalizer = weakref.finalize(self, _kill, self.process)
        self.conn = Connection(ours.detach())
        self.started_at = time.monotonic()
        self.ready = False
        self.task: int | None = None
        self.deadline = math.inf
        self.conn.send(list(sys.path))
        self.conn.send(target)

    def exit_code(self) -> int | None:
        """The exit code once the process has gone (it may lag its pipe's EOF briefly)."""
        try:
            return self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, *, kill: bool) -> None:
        """Ask the worker to exit (or kill it right away), then release its resources."""
        if not kill:
            with contextlib.suppress(OSError):  # already gone
                self.conn.send(None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1.0)
        self._finalizer()
        self.conn.close()


class WorkerPool(Generic[T]):
    """`num_workers` processes running `target(*args)` calls, each under a deadline.

    `target` must pickle by reference (a module-level function, or an instance of an importable
    class); workers are started right away so that the first `run` finds them warm.
    """

    def __init__(
        self,
        target: Callable[..., T],
        num_workers: int = 1,
        *,
        startup_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.target = target
        self.restarts = 0  # workers replaced after a timeout or crash
        self._startup_timeout_s = startup_timeout_s
        self._closed = False
        self._workers = [_Worker(target) for _ in range(num_workers)]

    def __enter__(self) -> WorkerPool[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop all workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.stop(kill=worker.task is not None or not worker.ready)

    def wait_ready(self) -> None:
        """Block until every worker has started (e.g. before timing calls, or to warm up)."""
        if self._closed:
            raise RuntimeError("the pool is closed")
        try:
            while not all(w.ready for w in self._workers):
                self._collect([])
                self._enforce_deadlines([])
        except WorkerStartupError:
            self.close()
            raise

    def run(self, calls: Sequence[tuple[object, ...]], timeout_s: float) -> list[Outcome[T]]:
        """Run `target(*args)` for each args tuple; outcomes in the order of `calls`.

        Each call gets `timeout_s` seconds of wall time on a worker. Raises WorkerStartupError
        (and closes the pool) when a worker cannot start, which no retry would fix.
        """
        if self._closed:
            raise RuntimeError("the pool is closed")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        results: list[Outcome[T] | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        try:
            while queue or any(w.task is not None for w in self._workers):
                self._dispatch(queue, calls, timeout_s)
                self._collect(results)
                self._enforce_deadlines(results)
        except WorkerStartupError:
            self.close()
            raise
        done: list[Outcome[T]] = []
        for outcome in results:
            assert outcome is not None  # the loop ends only when every call has an outcome
            done.append(outcome)
        return done

    def _replace(self, worker: _Worker, *, kill: bool) -> None:
        worker.stop(kill=kill)
        self._workers[self._workers.index(worker)] = _Worker(self.target)
        self.restarts += 1

    def _dispatch(
        self, queue: deque[int], calls: Sequence[tuple[object, ...]], timeout_s: float
    ) -> None:
        for worker in list(self._workers):
            if not queue:
                return
            if not worker.ready or worker.task is not None:
                continue
            task = queue.popleft()
            try:
                worker.conn.send((task, calls[task]))
            except OSError:
                # It died while idle: the call never started, so it goes back to the queue.
                queue.appendleft(task)
                self._replace(worker, kill=True)
                continue
            worker.task = task
            worker.deadline = time.monotonic() + timeout_s

    def _collect(self, results: list[Outcome[T] | None]) -> None:
        waiting = {w.conn: w for w in self._workers if w.task is not None or not w.ready}
        if not waiting:
            return
        next_deadline = min(
            w.deadline if w.ready else w.started_at + self._startup_timeout_s
            for w in waiting.values()
        )
        for conn in wait(list(waiting), timeout=max(0.0, next_deadline - time.monotonic())):
            assert isinstance(conn, Connection)
            self._receive(waiting[conn], results)

    def _receive(self, worker: _Worker, results: list[Outcome[T] | None]) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.exit_code()
            if not worker.ready:
                raise WorkerStartupError(
                    f"a verifier worker exited with code {code} before it was ready; is the "
                    f"target importable in a fresh interpreter (sys.path, module-level)?"
                ) from None
            # Only busy and starting workers are waited on, so this one was running a call.
            assert worker.task is not None
            results[worker.task] = Raised(f"WorkerCrashed: worker process exited with code {code}")
            self._replace(worker, kill=True)
            return
        except Exception as exc:
            # The reply arrived whole but does not unpickle here; the worker itself is fine.
            if worker.task is not None:
                results[worker.task] = Raised(_describe(exc))
                worker.task = None
            return
        if message == _READY:
            worker.ready = True
            return
        if isinstance(message, tuple) and message[0] == _STARTUP_FAILED:
            raise WorkerStartupError(f"a verifier worker could not load its target: {message[1]}")
        task, ok, payload = message
        if task != worker.task:
            raise RuntimeError(f"worker answered call {task} while running call {worker.task}")
        # `ok` says the worker's call returned: payload is the target's T, else a description.
        results[task] = Done(payload) if ok else Raised(str(payload))
        worker.task = None

    def _enforce_deadlines(self, results: list[Outcome[T] | None]) -> None:
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.task is not None and now >= worker.deadline:
                results[worker.task] = TimedOut()
                self._replace(worker, kill=True)
            elif not worker.ready and now >= worker.started_at + self._startup_timeout_s:
                raise WorkerStartupError(
                    f"a verifier worker was not ready within {self._startup_timeout_s:g} s"
                )
