"""The reconciler: brings the store and Ray's jobs back into agreement after a crash.

It closes the gaps a crash can leave between the store and Ray:

- a run whose job failed without recording its outcome (its driver died, or was killed before
  it could report) is submitted again as a new job (`RUN_ID.r1`, `.r2`, ...: see
  `services.jobs.launcher`), whose driver resumes from the run's latest checkpoint, up to
  `driver_restarts` times (KPO_DRIVER_RESTARTS); after that the run fails, with the tail of the
  last job's log as its error. A job that failed only because Ray found no room to start it in
  time (it waited for a driver slot) does not count: its driver never ran.
- a running run whose job is gone (the Ray cluster was restarted, and its driver with it) is
  submitted again in the same way, within the same budget. The count of restarts is kept in the
  store (`RunRecord.driver_restarts`), since Ray's job history goes with its cluster.
- a run that was cancelled is never submitted again: a cancel was requested (the API stores the
  request, `cancel_requested_at`, before it asks Ray to stop the job, so every control plane sees
  it: another replica, one restarted since), its job was stopped (Ray says STOPPED), or its driver
  exited as a cancelled run does (exit code 130). It is recorded `cancelled`.
- a run whose job succeeded without the run saying so is recorded `succeeded`.
- a queued run with no job yet (the control plane died between storing and submitting it) is
  submitted; a job whose run was finished elsewhere (cancelled while still queued) is stopped.

`kpo serve` runs one in the background, so that a restarted control plane picks up every run it
had left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from ray.job_submission import JobDetails, JobStatus

from services.jobs.launcher import RayJobLauncher, RunJobs, never_started
from services.jobs.ray_head import LOG_TAIL_LINES
from services.store import (
    TERMINAL_STATUSES,
    InvalidTransition,
    RunNotFound,
    RunRecord,
    RunStatus,
    Store,
    StoreError,
)

log = logging.getLogger(__name__)

# How `kpo execute` exits for a cancelled run (services.cli EXIT_CODES): its driver took a
# SIGTERM for a cancel, whoever sent it.
CANCELLED_EXIT_CODE = 130


class Reconciler:
    """Reconciles the runs of `store` with the jobs of `launcher`: once (`reconcile`), or every
    `interval_s` in a background thread (`start`, until `close`).

    A job still alive `finish_grace_s` after its run finished (cancelled while it was queued) is
    stopped; the error of a run whose job ended without its outcome ends with the last
    `log_tail_lines` lines of the job's log. A run whose driver died is resubmitted up to
    `driver_restarts` times (default: the launcher's, from KPO_DRIVER_RESTARTS).
    """

    def __init__(
        self,
        launcher: RayJobLauncher,
        store: Store,
        *,
        interval_s: float = 5.0,
        finish_grace_s: float = 30.0,
        log_tail_lines: int = LOG_TAIL_LINES,
        driver_restarts: int | None = None,
    ) -> None:
        self.launcher = launcher
        self.store = store
        self.interval_s = interval_s
        self.finish_grace_s = finish_grace_s
        self.log_tail_lines = log_tail_lines
        self.driver_restarts = (
            launcher.driver_restarts if driver_restarts is None else driver_restarts
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Reconcile now and then every `interval_s` in a background thread, until `close()`."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while True:
                try:
                    self.reconcile()
                except Exception as error:  # Ray or the store is down: the next pass retries
                    log.warning("reconciling runs with Ray jobs failed: %s", error)
                if self._stop.wait(self.interval_s):
                    return

        self._thread = threading.Thread(target=loop, name="kpo-reconciler", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the background thread; the jobs themselves go on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def reconcile(self) -> list[str]:
        """One pass of bringing the store and Ray's jobs into agreement; what it did, in words.

        Ray's jobs are listed before the store is read, so a job seen as ended has made every
        write it will ever make: a run that still looks unfinished afterwards really is.
        """
        jobs = self.launcher.run_jobs()
        actions: list[str] = []
        for run in _unfinished_runs(self.store):
            action = self._reconcile_run(run, jobs.get(run.id))
            if action:
                actions.append(action)
        for attempts in jobs.values():
            if not attempts.latest.status.is_terminal():
                action = self._stop_if_finished(attempts)
                if action:
                    actions.append(action)
        for action in actions:
            log.info("reconciler: %s", action)
        return actions

    def _reconcile_run(self, run: RunRecord, attempts: RunJobs | None) -> str | None:
        if attempts is None and run.status == RunStatus.QUEUED:
            self.launcher.submit(run)
            return f"{run.id}: queued without a job; submitted"
        if attempts is None:
            attempts = self.launcher.jobs_of(run.id)  # listed before it was submitted, perhaps
            if attempts is None:
                return self._reconcile_lost_job(run)
        job = attempts.latest
        if not job.status.is_terminal():
            return None
        if job.status == JobStatus.SUCCEEDED:
            return self._record_outcome(run, RunStatus.SUCCEEDED, None)
        # The stored request covers a cancel that reached any control plane, and one whose stop
        # never reached Ray (its driver died first, or the job server could not be reached).
        cancelled = (
            run.cancel_requested_at is not None
            or job.status == JobStatus.STOPPED
            or job.driver_exit_code == CANCELLED_EXIT_CODE
        )
        # Ray's jobs count the restarts since the cluster started, the store's count those before
        # it too; either may be behind the other (see `_resubmit`).
        restarts = max(run.driver_restarts, attempts.driver_attempts - 1)
        if not cancelled and never_started(job):
            why = "Ray found no room to start its job in time"
            return self._resubmit(run, attempts.next_attempt, why, job, restarts=None)
        if not cancelled and restarts < self.driver_restarts:
            why = "its driver ended without recording an outcome"
            return self._resubmit(run, attempts.next_attempt, why, job, restarts=restarts + 1)
        state = RunStatus.CANCELLED if cancelled else RunStatus.FAILED
        tail = self.launcher.log_tail(job.submission_id or run.id, self.log_tail_lines)
        tried = "" if cancelled else f", after {_attempts(restarts + 1)}"
        if run.cancel_requested_at is not None:
            tried += f", cancel requested at {run.cancel_requested_at.isoformat()}"
        error = (
            f"its Ray job ended {job.status.value} before the run recorded its outcome "
            f"({job.message or 'no message'}; job {job.submission_id}, driver exit code "
            f"{job.driver_exit_code}{tried}); last lines of its log:\n{tail}"
        )
        return self._record_outcome(run, state, error)

    def _reconcile_lost_job(self, run: RunRecord) -> str | None:
        """A running run of which Ray knows no job: its cluster was restarted (the head pod, or
        the whole RayCluster), and the driver went with it."""
        gone = "its Ray job no longer exists (was the Ray cluster restarted?)"
        if run.cancel_requested_at is not None:
            return self._record_outcome(run, RunStatus.CANCELLED, gone)
        if run.driver_restarts < self.driver_restarts:
            # The job ids of the cluster that was lost are free again in this one.
            restarts = run.driver_restarts + 1
            return self._resubmit(run, restarts, gone, None, restarts=restarts)
        used = f"restarts ({self.driver_restarts}) were used up"
        return self._record_outcome(
            run, RunStatus.FAILED, f"{gone}; not submitted again: its {used}"
        )

    def _resubmit(
        self,
        run: RunRecord,
        attempt: int,
        why: str,
        ended: JobDetails | None,
        *,
        restarts: int | None,
    ) -> str | None:
        """Submit the run again as the job of `attempt`, whose driver resumes from its latest
        checkpoint, after the job `ended` (None: Ray has none left). `restarts`: the run's
        restart count with this one, None when it does not count (its driver never started)."""
        created = self.launcher.submit_attempt(run, attempt)
        if restarts is not None:
            # Counted only once the job exists: the job id is what keeps two control planes
            # from both restarting the driver, and one that read this count before it rose
            # finds the job by then. Counted even when another control plane's reconciler made
            # the job (it counts the same number). A control plane that dies in between leaves
            # the count one behind, which Ray's own attempts make up while its cluster lives.
            self.store.record_driver_restarts(run.id, restarts)
        # A cancel made after this pass read the run may have looked for a live job to stop
        # before this one existed, and found none. It stored its request before it looked, so
        # the request is seen here (whichever control plane took the cancel) and the new job
        # stopped at once; a cancel that looks later finds the new job and stops it itself.
        if self.store.get_run(run.id).cancel_requested_at is not None:
            self.launcher.stop(run.id)
        if not created:
            return None  # another control plane's reconciler submitted it (and said so)
        restart = (
            f"restart {restarts} of {self.driver_restarts}"
            if restarts is not None
            else "not counted as a restart"
        )
        last_job = (
            f"Ray job {ended.submission_id}: {ended.status.value}, {ended.message or 'no message'}"
            if ended is not None
            else "no job of the run on this Ray cluster"
        )
        line = (
            f"[kpo] {why} ({last_job}); submitted it again as attempt {attempt} "
            f"({restart}), which resumes from the run's latest checkpoint, if it has one"
        )
        try:
            self.store.append_logs(run.id, [line])
        except StoreError as error:  # the log line is for the user; the resubmission stands
            log.warning("run %s: log line not stored: %s", run.id, error)
        return f"{run.id}: {why} ({last_job}); resubmitted ({restart})"

    def _record_outcome(self, run: RunRecord, state: RunStatus, error: str | None) -> str | None:
        try:
            if state == RunStatus.SUCCEEDED and run.status == RunStatus.QUEUED:
                self.store.transition(run.id, RunStatus.RUNNING)  # its own report was lost
            self.store.transition(run.id, state, error)
        except InvalidTransition:
            return None  # its driver (or a cancel) got there in between
        return f"{run.id}: its job ended without a recorded outcome; recorded {state.value}"

    def _stop_if_finished(self, attempts: RunJobs) -> str | None:
        """Stop a live job whose run has finished already (cancelled while it was queued), or
        whose cancel was stored `finish_grace_s` ago and is still running (the stop may never
        have reached Ray: the route answered 503, or the job was resubmitted meanwhile)."""
        try:
            run = self.store.get_run(attempts.run_id)
        except RunNotFound:
            return None  # a job of another control plane sharing this cluster
        if run.status in TERMINAL_STATUSES:
            since, why = run.transitions[-1].at, run.status.value
        elif run.cancel_requested_at is not None:
            since, why = run.cancel_requested_at, "cancel requested"
        else:
            return None
        if time.time() - since.timestamp() < self.finish_grace_s:
            return None  # its driver is finishing its step (or on its way out)
        # Stopping a job that is stopping already is harmless: Ray only sets its stop event.
        self.launcher.stop(run.id)
        job = attempts.latest
        return f"{run.id}: {why} but its job {job.submission_id} was {job.status.value}; stopped it"


def _attempts(count: int) -> str:
    return "1 attempt" if count == 1 else f"{count} attempts"


def _unfinished_runs(store: Store) -> Iterator[RunRecord]:
    """Every run that is queued or running, oldest pages last."""
    for status in (RunStatus.RUNNING, RunStatus.QUEUED):
        cursor: str | None = None
        while True:
            runs, cursor = store.list_runs(status, limit=100, cursor=cursor)
            yield from runs
            if cursor is None:
                break
