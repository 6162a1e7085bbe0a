"""The one engine worker: a thread that owns a ``DecodeCore`` and serves a bounded FIFO queue.

Callers (the HTTP server's handlers, a benchmark) ``submit`` requests from any thread and get
a ``RequestHandle``; the worker calls the handle's ``on_event`` from its own thread with
``TokensEvent``s, then one ``DoneEvent`` (or ``ErrorEvent``). Scheduling is first come, first
served: a free slot goes to the oldest queued request, and every admitted sequence advances by
one round in every step, so no sequence waits behind another's whole generation.
``handle.cancel()`` frees the sequence's slot and cache at the next step boundary (or drops
it from the queue), so a slot is never held by a client that has gone away.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .core import DecodeCore, SequenceRequest, StepReport


class QueueFullError(RuntimeError):
    """The queue holds ``max_queue`` requests already: try again later (HTTP 429)."""


class EngineUnavailableError(RuntimeError):
    """The worker is not running (not started, stopped, or shutting down) (HTTP 503)."""


@dataclass
class TokensEvent:
    events: list  # StreamEvent list (token_id None: a final text flush)


@dataclass
class DoneEvent:
    finish_reason: str  # "stop" | "length"
    token_ids: list  # all generated ids
    text: str  # all generated text (stop string excluded)
    stats: dict  # per-request speculation stats (DecodeCore.stats_for)


@dataclass
class ErrorEvent:
    message: str  # what failed (the engine raised while running this request)


class RequestHandle:
    """One submitted request. ``on_event`` runs on the worker thread: keep it short and non-blocking."""

    _ids = itertools.count()

    def __init__(self, prompt_ids, params, on_event: Callable[[object], None]):
        self.request_id = f"req-{next(self._ids)}"
        self.request = SequenceRequest(self.request_id, list(prompt_ids), params)
        self.on_event = on_event
        self.submitted = time.perf_counter()
        self.cancelled = threading.Event()
        self.finished = False  # set by the worker after the DoneEvent / ErrorEvent

    def cancel(self) -> None:
        """Stop generating and free the slot (no further events are delivered)."""
        self.cancelled.set()


class EngineWorker:
    """Runs ``generator`` on one thread. ``on_step(report, queue_depth)`` observes every step (metrics)."""

    def __init__(self, generator: DecodeCore, max_queue: int = 128,
                 on_step: Callable[[StepReport | None, int, int], None] | None = None,
                 on_cancel: Callable[[RequestHandle], None] | None = None):
        self.generator = generator
        self.max_queue = max_queue  # queued (not yet admitted) requests beyond which submit raises QueueFullError
        self.on_step = on_step  # (report or None, active sequences, queue depth) after each step / admission
        self.on_cancel = on_cancel  # a cancelled request left its slot or the queue
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[str, RequestHandle] = {}
        self._cond = threading.Condition()
        self._running = False
        self._paused = False
        self._parked = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- control ------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._running:
                return
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="specrt-engine-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the current step; queued and active requests get an ErrorEvent."""
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def pause(self, timeout: float = 10.0) -> None:
        """Stop stepping after the current step (requests keep queueing); returns once parked."""
        with self._cond:
            self._paused = True
            self._parked.clear()
            self._cond.notify_all()
        if not self._parked.wait(timeout):
            raise TimeoutError("the worker did not park")

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def running(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self.generator.rows)

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, prompt_ids, params, on_event: Callable[[object], None]) -> RequestHandle:
        """Queue a request (thread-safe). Raises QueueFullError or EngineUnavailableError."""
        handle = RequestHandle(prompt_ids, params, on_event)
        with self._cond:
            if not self.running:
                raise EngineUnavailableError("the engine worker is not running")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            self._queue.append(handle)
            self._cond.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        handle.cancel()
        with self._cond:
            self._cond.notify_all()

    # ---- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        gen = self.generator
        while True:
            with self._cond:
                while self._running and (self._paused or not (self._queue or gen.rows)):
                    if self._paused:
                        self._parked.set()
                    self._cond.wait(0.5)
                if not self._running:
                    break
                admitted = []
                while self._queue and len(admitted) < gen.free_slots:
                    handle = self._queue.popleft()
                    if handle.cancelled.is_set():
                        self._cancelled(handle)
                    else:
                        admitted.append(handle)
            try:
                self._drop_cancelled()
                for handle in admitted:
                    self._admit(handle)
                if gen.rows:
                    updates, report = gen.step()
                    for update in updates:
                        self._deliver(update)
                    self._report(report)
            except Exception as e:  # an engine failure fails the requests in flight, not the server
                self._fail_all(f"{type(e).__name__}: {e}")
        self._fail_all("the server is shutting down", include_queue=True)

    def _admit(self, handle: RequestHandle) -> None:
        try:
            update = self.generator.add(handle.request)
        except Exception as e:  # this request's prefill failed: only it fails
            self.generator.remove(handle.request_id)
            handle.finished = True
            handle.on_event(ErrorEvent(f"{type(e).__name__}: {e}"))
            return
        self._active[handle.request_id] = handle
        self._deliver(update)
        self._report(None)

    def _drop_cancelled(self) -> None:
        for rid, handle in list(self._active.items()):
            if handle.cancelled.is_set():
                self.generator.remove(rid)
                del self._active[rid]
                self._cancelled(handle)

    def _cancelled(self, handle: RequestHandle) -> None:
        handle.finished = True
        if self.on_cancel is not None:
            self.on_cancel(handle)

    def _deliver(self, update) -> None:
        handle = self._active.get(update.request_id)
        if handle is None:
            return
        if handle.cancelled.is_set():  # cancelled during the step: free the slot now, deliver nothing
            self.generator.remove(update.request_id)
            del self._active[update.request_id]
            self._cancelled(handle)
            return
        if update.events:
            handle.on_event(TokensEvent(update.events))
        if update.finish_reason:
            del self._active[update.request_id]
            handle.finished = True
            handle.on_event(DoneEvent(update.finish_reason, update.token_ids, update.text, update.stats))

    def _report(self, report: StepReport | None) -> None:
        if self.on_step is not None:
            self.on_step(report, len(self.generator.rows), len(self._queue))

    def _fail_all(self, message: str, include_queue: bool = False) -> None:
        handles = list(self._active.values())
        self._active.clear()
        for row in list(self.generator.rows):
            self.generator.remove(row.request.request_id)
        if include_queue:
            with self._cond:
                handles += list(self._queue)
                self._queue.clear()
        for handle in handles:
            handle.finished = True
            if not handle.cancelled.is_set():
                handle.on_event(ErrorEvent(message))
        self._report(None)
