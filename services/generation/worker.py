"""The generation worker: a threaded Ray actor that keeps one backend decoding from a queue.

One engine thread owns the backend and drives `backend.step()` while anything is in flight;
the actor's method calls (Ray runs up to `MAX_CONCURRENCY` at once, so a `next_groups` blocked
waiting never blocks a `submit` or an offer) only touch the shared state under one lock, and
hand anything that needs the backend (a collective receive, joining a weight group) to the
engine thread, which runs it between two steps.

- `submit(requests)` queues groups; `next_groups(timeout_s)` returns every group that ended
  since the last call, as soon as one has (or nothing after the timeout), with the requests
  the backend refused meanwhile. `generate` is the blocking form for evaluation and
  benchmarks; its groups decode in the same running batch.
- Weights: `offer_weights(version, [offer])` records the newest object-store offer (a
  `WeightsOffer`, in a one-element list so Ray hands over its bucket refs unfetched; an older
  offer not yet loaded is dropped unfetched). The engine loads it when there is work to do:
  - `in_flight_updates=True`: at the next step boundary; responses in flight continue with the
    new weights (their tokens say which version sampled them), over the KV cache the old
    weights computed unless `recompute_kv=True`;
  - False (the default): admission stops, the groups in flight end under the old weights, the
    weights are swapped, admission resumes: every response is sampled by one version.
  A worker started with `load_when_idle=True` (a warm standby) loads an offer at once, idle.
  With the collective transport the learner broadcasts and every worker must receive at once:
  `receive_weights(manifest)` receives at the next step boundary, loading at once (in-flight
  updates, or nothing in flight) or staging on the CPU until the groups in flight have ended.
  Decoding pauses while the engine thread receives (or joins a group: at start and when the
  group is re-formed), since the backend's weights are what it would decode with.
- Faults (the policy is docs/reliability.md's table): a request the backend refuses (a prompt
  longer than its context, one that encodes to nothing) is not generated and not raised: it
  comes back from `next_groups` as a `Refusal` with its reason, and the other requests go on.
  A failed weight load is retried once from the same offer; a second failure keeps the offer
  and halts the engine (it never samples with weights older than it was offered):
  `next_groups` and `generate` raise `WeightSwapError` until a newer offer arrives, and the
  driver replaces the worker. Any other exception of the engine thread is fatal: every later
  call raises it (`EngineFailedError`), so the caller sees the worker's error instead of
  waiting on a dead engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

import ray
import torch
from ray.actor import ActorClass
from ray.exceptions import RayError

from services.generation.base import (
    GroupRequest,
    PromptTooLongError,
    Refusal,
    RefusalReason,
    SamplingSettings,
    StreamedGroups,
    group_requests,
    validate_requests,
    validate_sampling,
)
from services.generation.registry import create_backend
from services.messages import Prompt, Response
from services.tools.config import ToolsConfig
from services.tools.reaper import become_subreaper
from services.tools.rollout import build_runner
from services.weights.base import TensorSpec, WeightGroup, WeightsManifest, WeightsOffer
from services.weights.buckets import plan_buckets
from services.weights.delta import DeltaBase, DeltaMismatchError
from services.weights.object_store import fetch_buckets, fetch_patched, put_buckets, put_dense
from services.weights.sources import whole_sources

log = logging.getLogger(__name__)

StateDict: TypeAlias = Mapping[str, torch.Tensor]

# Loads of one offer before the worker gives up on it (the first may fail on a transient fetch).
LOAD_ATTEMPTS = 2

# Ray threads of the actor: enough for a blocked next_groups, a blocked generate, a collective
# receive and the short calls of a driver, all at once.
MAX_CONCURRENCY = 16


@dataclass(frozen=True)
class GenerationStats:
    """Counters of one worker since it started. Read by the run driver for metrics."""

    backend: str
    policy_version: int
    batches: int  # blocking `generate` calls
    tokens_generated: int  # response tokens of every returned group, EOS included
    last_batch_tokens: int  # of the latest `generate` call
    last_batch_seconds: float
    last_batch_tokens_per_s: float
    tokens_per_s: float  # all tokens over the time spent in backend steps
    weight_swaps: int
    failed_loads: int  # weight loads that raised (each offer is tried LOAD_ATTEMPTS times)
    dense_loads: int  # delta publishes loaded whole instead (new, behind, or a bad patch)
    peer_loads: int  # of them, those taken from a surviving worker's copy, not the learner's
    last_swap_seconds: float  # fetch + load (or receive + load) of the latest swap
    groups_returned: int  # streamed and generated
    groups_in_flight: int  # submitted and not yet returned
    steps: int
    busy_seconds: float  # in backend steps
    swap_seconds: float  # in all swaps
    in_flight_swaps: int  # swaps with responses in flight (in-flight updates)
    pending_version: int | None  # newest version offered or staged, not yet loaded
    in_flight_updates: bool
    # Multi-turn rollouts: tool calls run, by result status (ok, error, timeout, refused,
    # unavailable); empty without tools.
    tool_calls: dict[str, int] = field(default_factory=dict)


class EngineFailedError(RuntimeError):
    """The worker's engine thread died; the worker cannot generate any more."""


class WeightSwapError(RuntimeError):
    """Loading the newest offered weights failed; the worker waits for a newer offer."""


@dataclass(eq=False)
class _Offer:
    version: int
    source: WeightsOffer
    error: BaseException | None = None  # why its last load failed, once it is given up
    attempts: int = 0  # loads tried


@dataclass(frozen=True)
class _Route:
    """Where an ended group goes: the stream (ticket None) or a `generate` call."""

    ticket: int | None
    index: int
    prompt_id: str


@dataclass(eq=False)
class _Task:
    run: Callable[[], None]
    done: Future[None]


def _unwrap_offer(offer: Any) -> WeightsOffer:
    """The WeightsOffer inside an offer: a one-element list, so that Ray hands its bucket refs
    over without fetching them (the one offer format)."""
    inner = offer[0] if isinstance(offer, list) and len(offer) == 1 else None
    if not isinstance(inner, WeightsOffer):
        raise TypeError(
            f"a weights offer is a one-element list holding a WeightsOffer, got {offer!r:.80}"
        )
    return inner


class GenerationWorkerImpl:
    """The worker's logic (see the module docstring). `GenerationWorker` is it as an actor."""

    def __init__(
        self,
        backend: str,
        model_path: str,
        *,
        in_flight_updates: bool = False,
        recompute_kv: bool = False,
        tools: ToolsConfig | None = None,
        reap_call_orphans: bool = False,
        load_when_idle: bool = False,
        **options: Any,
    ) -> None:
        """Construct backend `backend` for `model_path` with its options and start the engine.

        `tools`: multi-turn rollouts (when enabled), the calls running where it says (sandboxed
        processes of this worker by default); the runner is built here, so a sandbox token is
        read from this process's environment. `reap_call_orphans`: make this process a child
        subreaper, so that the sandbox's local calls are reaped here after each call (a
        generation actor's process: the node's init may reap late or never, and an unreaped
        call counts against its slot's process budget until the next call cannot start).
        `load_when_idle`: load an offer as soon as it is recorded, work or not (a warm standby,
        which holds no work but must hold the newest version when it takes a lost worker's
        place); otherwise an offer waits for work, and one superseded meanwhile is never
        fetched.
        """
        if recompute_kv and not in_flight_updates:
            raise ValueError("recompute_kv applies to in_flight_updates: set that too")
        self._backend_name = backend
        self._backend = create_backend(backend, model_path, **options)
        self._backend.recompute_kv = recompute_kv
        if tools is not None and tools.enabled:
            if reap_call_orphans and tools.sandbox_url is None:
                become_subreaper()
            self._backend.enable_tools(tools, build_runner(tools))
        self._in_flight_updates = in_flight_updates
        self._load_when_idle = load_when_idle
        self._cv = threading.Condition()
        self._waiting: deque[GroupRequest] = deque()
        self._routes: dict[str, _Route] = {}
        self._serial = itertools.count()
        self._tickets = itertools.count()
        self._stream_out: list[list[Response]] = []
        self._generated: dict[int, dict[int, list[Response]]] = {}  # ticket -> index -> group
        self._offer: _Offer | None = None
        # Delta publishes: this worker's copy of the version it loaded last (what patches
        # apply to), and the delta offers newer than it, by version: a worker that loads
        # fewer versions than are published applies the whole chain.
        self._delta = DeltaBase()
        self._patched: dict[int, WeightsOffer] = {}
        # Held while the engine changes `_delta`, so a replacement's `dense_offer` reads one
        # whole version of it; `_held_manifest` describes what it holds.
        self._delta_lock = threading.Lock()
        self._held_manifest: WeightsManifest | None = None
        self._tasks: deque[_Task] = deque()
        self._fatal: BaseException | None = None
        self._refused: list[Refusal] = []  # stream requests the backend refused, not yet reported
        self._ticket_errors: dict[int, ValueError] = {}  # a `generate` call's refused request
        self._closing = False
        self._in_backend = 0  # groups handed to the backend and not yet returned
        self._stats: dict[str, Any] = {
            "batches": 0,
            "tokens_generated": 0,
            "last_batch_tokens": 0,
            "last_batch_seconds": 0.0,
            "weight_swaps": 0,
            "failed_loads": 0,
            "dense_loads": 0,
            "peer_loads": 0,
            "last_swap_seconds": 0.0,
            "groups_returned": 0,
            "steps": 0,
            "busy_seconds": 0.0,
            "swap_seconds": 0.0,
            "in_flight_swaps": 0,
        }
        self._thread = threading.Thread(target=self._run, name="generation-engine", daemon=True)
        self._thread.start()

    # --- streaming ------------------------------------------------------------------------------

    def submit(self, requests: list[GroupRequest]) -> None:
        """Queue groups for the engine (ValueError naming the prompt for bad settings)."""
        validate_requests(requests)
        with self._cv:
            self._raise_if_fatal()
            for request in requests:
                self._enqueue(request, _Route(None, 0, request.prompt.prompt_id))
            self._cv.notify_all()

    def next_groups(self, timeout_s: float) -> StreamedGroups:
        """Every group that ended since the last call, and every request refused meanwhile;
        blocks until there is one or `timeout_s` passed (nothing then). Raises the engine's
        error (fatal, or a weight load given up) once nothing is left to hand back."""
        with self._cv:
            self._cv.wait_for(
                lambda: bool(self._stream_out or self._refused) or self._error() is not None,
                timeout=timeout_s,
            )
            if self._stream_out or self._refused:
                out = StreamedGroups(self._stream_out, self._refused)
                self._stream_out, self._refused = [], []
                return out
            self._raise_error()
            return StreamedGroups([])

    def generate(
        self, prompts: list[Prompt], group_size: int, sampling: SamplingSettings
    ) -> list[list[Response]]:
        """`group_size` responses per prompt, in prompt order, blocking (seeds as in
        `GenerationBackend.generate`, so a seeded call gives what the backend's would)."""
        validate_sampling(sampling, group_size)
        if not prompts:
            return []
        start = time.perf_counter()
        with self._cv:
            self._raise_if_fatal()
            ticket = next(self._tickets)
            done = self._generated[ticket] = {}
            for index, request in enumerate(group_requests(prompts, group_size, sampling)):
                self._enqueue(request, _Route(ticket, index, request.prompt.prompt_id))
            self._cv.notify_all()
            try:
                self._cv.wait_for(
                    lambda: (
                        len(done) == len(prompts)
                        or ticket in self._ticket_errors
                        or self._error() is not None
                    )
                )
                if ticket in self._ticket_errors:
                    raise self._ticket_errors[ticket]
                if len(done) < len(prompts):
                    self._raise_error()
            finally:
                self._cancel(ticket)
            groups = [done[index] for index in range(len(prompts))]
            tokens = sum(len(r.response_token_ids) for group in groups for r in group)
            self._stats["batches"] += 1
            self._stats["last_batch_tokens"] = tokens
            self._stats["last_batch_seconds"] = time.perf_counter() - start
        return groups

    def _enqueue(self, request: GroupRequest, route: _Route) -> None:
        """Queue `request` under an id of its own: prompt ids may repeat (the stream and a
        `generate` call, or two groups of one prompt), routes must not. The original id leads,
        so a backend error naming it stays readable."""
        key = f"{request.prompt.prompt_id}#{next(self._serial)}"
        self._routes[key] = route
        self._waiting.append(replace(request, prompt=replace(request.prompt, prompt_id=key)))

    def _cancel(self, ticket: int) -> None:
        """Forget a finished or failed `generate` call; its groups still queued are dropped,
        those already decoding are discarded when they end."""
        self._generated.pop(ticket, None)
        self._ticket_errors.pop(ticket, None)
        kept = [r for r in self._waiting if self._routes[r.prompt.prompt_id].ticket != ticket]
        for request in self._waiting:
            if self._routes[request.prompt.prompt_id].ticket == ticket:
                del self._routes[request.prompt.prompt_id]
        self._waiting = deque(kept)

    # --- weights --------------------------------------------------------------------------------

    def offer_weights(self, version: int, offer: Any) -> bool:
        """Record weights of `version` for the engine to load (see the module docstring);
        False if not newer than what is loaded, staged or already offered."""
        source = _unwrap_offer(offer)
        if source.transport != "object_store":
            raise ValueError(
                f"offer_weights takes object_store offers; a {source.transport!r} offer is "
                "received with receive_weights"
            )
        if source.manifest.version != version:
            raise ValueError(
                f"offer of version {version} carries a manifest of version "
                f"{source.manifest.version}"
            )
        with self._cv:
            if source.patches:
                self._patched[version] = source  # a later chain may need it
            if version <= self._newest_version():
                return False
            self._offer = _Offer(version, source)
            self._cv.notify_all()
            return True

    def weight_receivers(self) -> int:
        """Processes of this worker that join a collective weight group."""
        return self._backend.weight_receivers()

    def join_weight_group(self, group: WeightGroup, first_rank: int) -> None:
        """Join the collective weight group (between two steps; blocks until all joined)."""
        self._in_engine(lambda: self._backend.join_weight_group(group, first_rank))

    def receive_weights(self, manifest: WeightsManifest) -> None:
        """Receive the version the learner is broadcasting now (see the module docstring)."""
        self._in_engine(lambda: self._receive(manifest))

    def _receive(self, manifest: WeightsManifest) -> None:
        """In the engine thread: load now, or stage until the groups in flight have ended."""
        apply = self._in_flight_updates or self._backend.in_flight == 0
        start = time.perf_counter()
        self._backend.receive_weights(manifest, apply=apply)
        if apply:
            self._swapped(start)
        with self._cv:
            if self._offer is not None and self._offer.version <= manifest.version:
                self._offer = None  # what was received is at least as new

    def _in_engine(self, run: Callable[[], None]) -> None:
        """Run `run` in the engine thread between two steps; wait for it and raise its error."""
        task = _Task(run, Future())
        with self._cv:
            self._raise_if_fatal()
            self._tasks.append(task)
            self._cv.notify_all()
        task.done.result()

    def _newest_version(self) -> int:
        versions = [self._backend.policy_version]
        if self._offer is not None:
            versions.append(self._offer.version)
        staged = self._backend.staged_version
        if staged is not None:
            versions.append(staged)
        return max(versions)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except BaseException as error:  # the worker is unusable: tell every caller why
            with self._cv:
                self._fatal = error
                failed = EngineFailedError(f"generation engine failed: {error!r}")
                for task in self._tasks:
                    task.done.set_exception(failed)
                self._tasks.clear()
                self._cv.notify_all()

    def _halted(self) -> bool:
        """No step now: the newest offer could not be loaded, or a receive stopped part-way
        (a peer of the weight group died mid-broadcast) and the version is sent again."""
        failed_offer = self._offer is not None and self._offer.error is not None
        return failed_offer or self._backend.torn_version is not None

    def _swap_due(self) -> bool:
        """New weights wait for the engine: admission stops until they are loaded."""
        return (
            self._offer is not None and self._offer.error is None
        ) or self._backend.staged_version is not None

    def _has_work(self) -> bool:
        if self._closing or self._tasks:
            return True
        if self._halted():
            return False
        if self._load_when_idle and self._swap_due():
            return True
        return bool(self._waiting) or self._in_backend > 0

    def _iterate(self) -> bool:
        """One pass of the engine: tasks, a due swap, admission, one step. False: stop."""
        with self._cv:
            self._cv.wait_for(self._has_work)
            if self._closing:
                return False
            tasks = list(self._tasks)
            self._tasks.clear()
        for task in tasks:
            try:
                task.run()
            except Exception as error:  # the caller's error (e.g. a mismatched manifest)
                task.done.set_exception(error)
            else:
                task.done.set_result(None)
        self._swap_if_due()
        with self._cv:
            if self._halted():
                return True
            if not self._swap_due() and self._waiting:
                self._hand_to_backend()
            if self._in_backend == 0:
                return True
        start = time.perf_counter()
        groups = self._backend.step()
        self._after_step(groups, time.perf_counter() - start)
        return True

    def _hand_to_backend(self) -> None:
        """Submit the waiting requests to the backend (under the lock). One the backend refuses
        (a prompt too long for its context, one that encodes to nothing) is answered with a
        refusal, not admitted; the others go ahead."""
        requests = list(self._waiting)
        self._waiting.clear()
        try:
            self._backend.submit(requests)
            accepted = requests
        except ValueError:
            accepted = []
            for request in requests:  # find the culprit(s): a refused submit queues nothing
                try:
                    self._backend.submit([request])
                    accepted.append(request)
                except ValueError as error:
                    self._reject(request, error)
        self._in_backend += len(accepted)

    def _reject(self, request: GroupRequest, error: ValueError) -> None:
        route = self._routes.pop(request.prompt.prompt_id)
        message = f"request for prompt {route.prompt_id!r} refused by the backend: {error}"
        if route.ticket is None:
            reason: RefusalReason = (
                "prompt_too_long" if isinstance(error, PromptTooLongError) else "refused"
            )
            self._refused.append(Refusal(route.prompt_id, reason, message))
        elif route.ticket in self._generated:
            self._ticket_errors[route.ticket] = ValueError(message)
        self._cv.notify_all()

    def _swap_if_due(self) -> None:
        """Load a pending offer or staged weights when the swap policy allows it now."""
        drained = self._backend.in_flight == 0
        if self._backend.staged_version is not None and drained:
            start = time.perf_counter()
            self._backend.apply_staged()
            self._swapped(start)
        with self._cv:
            offer = self._offer
        if offer is None or offer.error is not None:
            return
        if not (self._in_flight_updates or drained):
            return
        start = time.perf_counter()
        try:
            if offer.version > self._backend.policy_version:
                offer.attempts += 1
                self._load(offer)
                self._swapped(start)
        except Exception as error:
            with self._cv:
                self._stats["failed_loads"] += 1
                if offer.attempts >= LOAD_ATTEMPTS:  # else the next pass loads it again
                    offer.error = error
                    self._cv.notify_all()
            return
        with self._cv:
            if self._offer is offer:
                self._offer = None

    def _load(self, offer: _Offer) -> None:
        source = offer.source
        if not source.patches:
            self._backend.load_weight_buckets(fetch_buckets(source), source.manifest)
            return
        with self._delta_lock:
            chain = self._chain_to(source.version)
            if chain is not None:
                try:
                    self._load_patched(chain)
                    return
                except DeltaMismatchError as error:
                    log.warning(
                        "weights of version %d: %s; loading them whole", offer.version, error
                    )
            # New, behind by a version it was not offered, or a patch that failed its digest:
            # the version whole, from the nearest copy (a surviving worker's, or the learner's).
            self._load_whole(source)

    def _load_patched(self, chain: list[WeightsOffer]) -> None:
        """Apply `chain` to the copy held and load the result (under `_delta_lock`)."""
        manifest = chain[-1].manifest
        self._backend.load_weight_buckets(fetch_patched(chain, self._delta), manifest)
        self._held_manifest = manifest
        self._loaded_patches()

    def _load_whole(self, offer: WeightsOffer) -> None:
        """Load `offer`'s version (or a newer one) whole from the first of its sources that
        gives it: a peer that lost it, died or fails meanwhile is passed over for the next."""
        if offer.source is None:
            raise DeltaMismatchError(f"version {offer.version}: no source of whole weights")
        sources = whole_sources(offer)
        for source in sources:
            try:
                dense: WeightsOffer = ray.get(source.actor.dense_offer.remote(offer.version))
                self._load_patched([dense])
            except (RayError, DeltaMismatchError) as error:
                if source.kind == "learner":
                    raise
                log.info("a peer's copy of version %d failed (%s): next", offer.version, error)
                continue
            with self._cv:
                self._stats["dense_loads"] += 1
                self._stats["peer_loads"] += source.kind == "peer"
            return

    def dense_offer(self, at_least: int) -> WeightsOffer:
        """This worker's copy of the version it loaded last, whole, put into the object store
        here (delta publishes): a replacement on this node loads it rather than the learner's
        (services/weights/sources.py). Refused unless that version is `at_least`."""
        with self._delta_lock:
            held, manifest = self._delta.version, self._held_manifest
            if held is None or manifest is None or held < at_least:
                raise DeltaMismatchError(
                    f"this worker holds {'no version' if held is None else f'version {held}'}, "
                    f"not version {at_least} or newer"
                )
            return put_dense(self._delta, manifest)

    def _chain_to(self, version: int) -> list[WeightsOffer] | None:
        """The delta offers that build `version`, oldest first: back to the version held, or
        to one sent whole (a learner's first publish); None where one is missing."""
        held, chain = self._delta.version, list[WeightsOffer]()
        with self._cv:
            for back in range(version, -1, -1):
                offer = self._patched.get(back)
                if offer is None:
                    return None
                chain.insert(0, offer)
                whole = all(patch.encoding == "dense" for patch in offer.patches)
                if whole or held == back - 1:
                    return chain
        return None

    def _loaded_patches(self) -> None:
        """Let go of the delta offers no newer than the version now held."""
        with self._cv:
            held = self._delta.version if self._delta.version is not None else -1
            self._patched = {v: o for v, o in self._patched.items() if v > held}

    def _swapped(self, start: float) -> None:
        seconds = time.perf_counter() - start
        with self._cv:
            self._stats["weight_swaps"] += 1
            self._stats["last_swap_seconds"] = seconds
            self._stats["swap_seconds"] += seconds
            if self._backend.in_flight:
                self._stats["in_flight_swaps"] += 1

    def _after_step(self, groups: list[list[Response]], seconds: float) -> None:
        """Route the ended groups to the stream or their `generate` call."""
        with self._cv:
            self._stats["steps"] += 1
            self._stats["busy_seconds"] += seconds
            self._in_backend -= len(groups)
            for group in groups:
                route = self._routes.pop(group[0].prompt_id)
                restored = [replace(r, prompt_id=route.prompt_id) for r in group]
                self._stats["groups_returned"] += 1
                self._stats["tokens_generated"] += sum(len(r.response_token_ids) for r in group)
                if route.ticket is None:
                    self._stream_out.append(restored)
                elif route.ticket in self._generated:
                    self._generated[route.ticket][route.index] = restored
            if groups:
                self._cv.notify_all()

    # --- errors ---------------------------------------------------------------------------------

    def _error(self) -> BaseException | None:
        if self._fatal is not None:
            return self._fatal
        return self._offer.error if self._offer is not None else None

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise EngineFailedError(f"generation engine failed: {self._fatal!r}") from self._fatal

    def _raise_error(self) -> None:
        self._raise_if_fatal()
        if self._offer is not None and self._offer.error is not None:
            error = self._offer.error
            raise WeightSwapError(
                f"loading weights of version {self._offer.version} failed: {error}"
            ) from error

    # --- reporting and shutdown -----------------------------------------------------------------

    def policy_version(self) -> int:
        """Version of the weights loaded now (a pending offer is loaded when work arrives)."""
        return self._backend.policy_version

    def stats(self) -> GenerationStats:
        """Throughput and counters since the worker started."""
        with self._cv:
            s = dict(self._stats)
            in_flight = self._in_backend + len(self._waiting)
            pending = self._newest_version()
        version = self._backend.policy_version
        return GenerationStats(
            backend=self._backend_name,
            policy_version=version,
            batches=s["batches"],
            tokens_generated=s["tokens_generated"],
            last_batch_tokens=s["last_batch_tokens"],
            last_batch_seconds=s["last_batch_seconds"],
            last_batch_tokens_per_s=_rate(s["last_batch_tokens"], s["last_batch_seconds"]),
            tokens_per_s=_rate(s["tokens_generated"], s["busy_seconds"]),
            weight_swaps=s["weight_swaps"],
            failed_loads=s["failed_loads"],
            dense_loads=s["dense_loads"],
            peer_loads=s["peer_loads"],
            last_swap_seconds=s["last_swap_seconds"],
            groups_returned=s["groups_returned"],
            groups_in_flight=in_flight,
            steps=s["steps"],
            busy_seconds=s["busy_seconds"],
            swap_seconds=s["swap_seconds"],
            in_flight_swaps=s["in_flight_swaps"],
            pending_version=pending if pending > version else None,
            in_flight_updates=self._in_flight_updates,
            tool_calls=self._backend.tool_call_counts(),
        )

    def close(self) -> None:
        """Stop the engine thread (groups in flight are dropped) and close the backend (its
        tool calls' client with it); for use outside Ray."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        self._backend.close()


# Applied as a call, not as a class decorator, so that type checkers see an actor class
# (`.remote`, `.options`) rather than the plain class; ray's typed overloads of `remote` lack
# `max_concurrency`, hence the untyped alias.
_actor_options: Callable[..., Callable[[type], Any]] = ray.remote
GenerationWorker: ActorClass[GenerationWorkerImpl] = _actor_options(
    max_concurrency=MAX_CONCURRENCY
)(GenerationWorkerImpl)


def _rate(tokens: int, seconds: float) -> float:
    """Tokens per second, 0.0 before anything was timed."""
    return tokens / seconds if seconds > 0 else 0.0


def offer_weights_to(
    workers: Sequence[Any], version: int, state_dict: StateDict, bucket_mb: int = 256
) -> tuple[WeightsOffer, list[ray.ObjectRef[bool]]]:
    """Put `state_dict` into the object store in buckets and offer it to every worker handle.

    Returns the offer and one acknowledgement ref per worker (True where the offer was newer
    than what that worker held). The bucket objects live as long as the calling process (their
    owner) and a ref to them do. Tied tensors (one storage under two names) are sent once.
    """
    first_name: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    specs: list[TensorSpec] = []
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in first_name:
            aliases[name] = first_name[key]
            continue
        first_name[key] = name
        specs.append(
            TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        )
    plan = plan_buckets(specs, bucket_mb * 2**20)
    manifest = WeightsManifest(version, plan, aliases)
    offer = put_buckets(manifest, ({spec.name: state_dict[spec.name] for spec in b} for b in plan))
    acks: list[ray.ObjectRef[bool]] = [
        worker.offer_weights.remote(version, [offer]) for worker in workers
    ]
    return offer, acks
