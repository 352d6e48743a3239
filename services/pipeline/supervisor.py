"""The actor supervisor: replaces generation and verifier actors that die or hang, within the
run's fault budget (`pipeline.actor_replacements`), and keeps their pids in status.json. A lost
generation worker's place goes to a warm standby where the driver has one ready (`promote`).

Hung: a verifier call past `reward.call_timeout_s`, or a generation worker holding prompts that
returned no group past its stall deadline (`WorkerStream.stall_deadline`). A hung actor is
killed, so its calls fail like those of a dead one and take the same path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import ray
from ray.exceptions import RayActorError

from services.pipeline.actors import RunActors, start_generation_worker, start_verifier
from services.spec import RunSpec

log = logging.getLogger(__name__)

# role -> status.json key
ROLE_KEYS = {"generation": "generation", "standby": "standby", "verifier": "verifiers"}


class FaultBudgetExhausted(RuntimeError):
    """More actors died than the run's spec allows it to survive."""


class FaultCounters(Protocol):
    generation_replacements: int
    verifier_replacements: int
    standby_promotions: int


class ActorSupervisor:
    """Replacement of generation and verifier actors; `counters` receives the counts."""

    def __init__(
        self,
        spec: RunSpec,
        counters: Callable[[], FaultCounters],
        model_dir: Callable[[], Any],
        report_pids: Callable[[dict[str, list[int]]], None],
    ) -> None:
        self.spec = spec
        self._counters = counters
        self._model_dir = model_dir
        self._report_pids = report_pids
        self.pids: dict[str, list[int]] = {}
        self._new_pids: list[tuple[str, int, Any]] = []  # (role key, index, pid ref)
        self._hung: list[Any] = []  # handles killed as hung (each is killed once)

    def replace(
        self, actors: RunActors, role: str, index: int, dead: Any, error: BaseException
    ) -> Any | None:
        """Put a new actor at `actors.<role>[index]` (role: generation, standby or verifier);
        the new handle, or None when `dead` was replaced already (several calls failed with
        the same actor). A lost standby is a lost generation actor: it counts as one."""
        pool = _pool(actors, role)
        if pool[index] is not dead:
            return None
        c = self._charge(role, error)
        log.warning("%s actor %d failed (%s): replacing it", role, index, type(error).__name__)
        self.kill(dead)
        if role == "verifier":
            pool[index] = start_verifier(self.spec)
            c.verifier_replacements += 1
        elif role == "standby":
            pool[index] = start_generation_worker(self.spec, self._model_dir(), standby=True)
            c.generation_replacements += 1
        else:
            pool[index] = start_generation_worker(self.spec, self._model_dir())
            c.generation_replacements += 1
        self._ask_pid(role, index, pool[index])
        return pool[index]

    def promote(
        self, actors: RunActors, index: int, slot: int, dead: Any, error: BaseException
    ) -> Any | None:
        """Put standby `slot` at `actors.generation[index]` in place of `dead`, and start a new
        standby at `slot` (not waited for: it loads the model beside the run). The new
        standby's handle, or None when `dead` was replaced already.

        A promotion replaces a lost worker, so it counts once against
        `pipeline.actor_replacements` and in `generation_replacements`, as a replacement does;
        `standby_promotions` counts the replacements that were promotions.
        """
        if actors.generation[index] is not dead:
            return None
        c = self._charge("generation", error)
        log.warning(
            "generation actor %d failed (%s): standby %d takes its place",
            index,
            type(error).__name__,
            slot,
        )
        self.kill(dead)
        actors.generation[index] = actors.standby[slot]
        actors.standby[slot] = start_generation_worker(self.spec, self._model_dir(), standby=True)
        c.generation_replacements += 1
        c.standby_promotions += 1
        # Its pid moves with it, a pid still asked of it included.
        self.pids["generation"][index] = self.pids["standby"][slot]
        self._new_pids = [
            ("generation", index, ref) if (key, at) == ("standby", slot) else (key, at, ref)
            for key, at, ref in self._new_pids
        ]
        self._ask_pid("standby", slot, actors.standby[slot])
        self._report_pids(self.pids)
        return actors.standby[slot]

    def _charge(self, role: str, error: BaseException) -> FaultCounters:
        """The counters, once the fault budget is known to allow one more replacement."""
        c = self._counters()
        used = c.generation_replacements + c.verifier_replacements
        allowed = self.spec.pipeline.actor_replacements
        if used >= allowed:
            raise FaultBudgetExhausted(
                f"a {role} actor failed after {used} actors were replaced already "
                f"(pipeline.actor_replacements = {allowed}): {type(error).__name__}: {error}"
            ) from error
        return c

    def _ask_pid(self, role: str, index: int, handle: Any) -> None:
        # Asked now, read once the actor is up (a vLLM engine takes minutes): see record_pids.
        pid_ref = handle.__ray_call__.remote(lambda _self: os.getpid())
        self._new_pids.append((ROLE_KEYS[role], index, pid_ref))

    @staticmethod
    def kill(handle: Any) -> None:
        try:
            ray.kill(handle, no_restart=True)
        except Exception as kill_error:  # already gone, which is what we want
            log.debug("kill %s: %s", handle, kill_error)

    def kill_as_hung(self, handle: Any, what: str) -> None:
        """Kill an actor taken for hung (once): its calls then fail as a dead actor's do."""
        if any(handle is hung for hung in self._hung):
            return
        self._hung.append(handle)
        log.warning("%s: taking it for hung", what)
        ray.kill(handle, no_restart=True)

    def stop_hung_verifiers(self, calls: Iterable[tuple[Any, int, float]]) -> None:
        """Kill a verifier actor whose call (actor, index, started) ran past its timeout.

        Checks inside an actor have their own timeout (reward.timeout_s); this catches the actor
        itself stuck.
        """
        limit = self.spec.reward.call_timeout_s
        now = time.perf_counter()
        for actor, index, started in calls:
            if now - started > limit:
                self.kill_as_hung(
                    actor,
                    f"verifier actor {index} has not answered in {now - started:.0f} s "
                    "(reward.call_timeout_s)",
                )

    def record_pids(self) -> None:
        """Put the pids of replacement actors that are up into status.json, for operators."""
        if not self._new_pids:
            return
        refs = [ref for _, _, ref in self._new_pids]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if not ready:
            return
        waiting = []
        for key, index, ref in self._new_pids:
            if ref not in ready:
                waiting.append((key, index, ref))
                continue
            # One that died while starting is replaced again when its first call fails.
            with contextlib.suppress(RayActorError):
                self.pids[key][index] = ray.get(ref)
        self._new_pids = waiting
        self._report_pids(self.pids)

    # --- an elastic pool's workers (services/pipeline/elastic.py) ----------------------------

    def added(self, actors: RunActors, handle: Any) -> None:
        """A worker added at the end of `actors.generation`: its pid joins status.json once
        it is up (0 until then)."""
        index = len(actors.generation) - 1
        pids = self.pids.setdefault(ROLE_KEYS["generation"], [])
        pids.extend([0] * (index + 1 - len(pids)))
        pid_ref = handle.__ray_call__.remote(lambda _self: os.getpid())
        self._new_pids.append((ROLE_KEYS["generation"], index, pid_ref))

    def removed(self, index: int) -> None:
        """The last worker, at `index`, left the pool: its pid leaves status.json."""
        key = ROLE_KEYS["generation"]
        self._new_pids = [e for e in self._new_pids if (e[0], e[1]) != (key, index)]
        pids = self.pids.get(key, [])
        del pids[index:]
        self._report_pids(self.pids)


def _pool(actors: RunActors, role: str) -> list[Any]:
    """The handles of `role` (generation, standby, verifier)."""
    if role == "verifier":
        return actors.verifiers
    return actors.standby if role == "standby" else actors.generation
