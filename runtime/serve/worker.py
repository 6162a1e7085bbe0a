"""The one engine worker: a thread that owns a ``DecodeCore`` and serves a bounded FIFO queue.

Callers (the HTTP server's handlers, a benchmark) ``submit`` requests from any thread and get
a ``RequestHandle``; the worker calls the handle's ``on_event`` from its own thread with
``TokensEvent``s, then one ``DoneEvent`` per choice (or one ``ErrorEvent``). A request of n
choices is n sequences admitted together (one prefill, ``DecodeCore.add_group``); events name
their choice by ``index``. Scheduling is first come, first served: free slots go to the oldest
queued request, and every admitted sequence advances by one round in every step, so no
sequence waits behind another's whole generation.
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

from ..core import DecodeCore, SequenceRequest, StepReport


class QueueFullError(RuntimeError):
    """The queue holds ``max_queue`` requests already: try again later (HTTP 429)."""


class EngineUnavailableError(RuntimeError):
    """The worker is not running (not started, stopped, or shutting down) (HTTP 503)."""


@dataclass
class TokensEvent:
    events: list  # StreamEvent list (token_id None: a final text flush)
    index: int = 0  # which choice


@dataclass
class DoneEvent:
    finish_reason: str  # "stop" | "length"
    token_ids: list  # all generated ids
    text: str  # all generated text (stop string excluded)
    stats: dict  # per-request speculation stats (DecodeCore.stats_for)
    index: int = 0  # which choice


@dataclass
class ErrorEvent:
    message: str  # what failed (the engine raised while running this request)


class RequestHandle:
    """One submitted request (n choices). ``on_event`` runs on the worker thread: keep it short and non-blocking."""

    _ids = itertools.count()

    def __init__(self, prompt_ids, params: list, on_event: Callable[[object], None], cache_scope: str | None = None,
                 **fields):
        self.request_id = f"req-{next(self._ids)}"
        self.requests = [SequenceRequest(f"{self.request_id}.{i}", list(prompt_ids), p, cache_scope, **fields)
                         for i, p in enumerate(params)]
        self.index = {r.request_id: i for i, r in enumerate(self.requests)}  # sequence id -> choice index
        self.on_event = on_event
        self.submitted = time.perf_counter()
        self.cancelled = threading.Event()
        self.running = len(params)  # choices not finished yet
        self.finished = False  # set by the worker after the last DoneEvent / the ErrorEvent

    def cancel(self) -> None:
        """Stop generating and free the slot (no further events are delivered)."""
        self.cancelled.set()


class EngineWorker:
    """Runs ``generator`` on one thread. ``on_step(report, queue_depth)`` observes every step (metrics)."""

    def __init__(self, generator: DecodeCore, max_queue: int = 128,
                 on_step: Callable[[StepReport | None, int, int], None] | None = None,
                 on_cancel: Callable[[RequestHandle], None] | None = None,
                 on_admit: Callable[[float], None] | None = None):
        self.generator = generator
        self.max_queue = max_queue  # queued (not yet admitted) requests beyond which submit raises QueueFullError
        self.on_step = on_step  # (report or None, active sequences, queue depth) after each step / admission
        self.on_cancel = on_cancel  # a cancelled request left its slot or the queue
        self.on_admit = on_admit  # (seconds the request waited in the queue) when it gets its slots
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
    def submit(self, prompt_ids, params, on_event: Callable[[object], None],
               cache_scope: str | None = None, **fields) -> RequestHandle:
        """Queue a request (thread-safe): ``params`` one ``SamplingParams`` or a list, one per choice;
        ``cache_scope`` and ``fields`` (grammar, method, gamma): ``SequenceRequest``'s, shared by the choices.
        Raises QueueFullError, EngineUnavailableError, or ValueError (more choices than slots)."""
        params = list(params) if isinstance(params, (list, tuple)) else [params]
        if not 1 <= len(params) <= self.generator.config.max_batch:
            raise ValueError(f"n={len(params)} choices: this server decodes at most "
                             f"{self.generator.config.max_batch} sequences at once (--max-batch)")
        handle = RequestHandle(prompt_ids, params, on_event, cache_scope, **fields)
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
                admitted, free = [], gen.free_slots
                while self._queue and len(self._queue[0].requests) <= free:
                    handle = self._queue.popleft()
                    if handle.cancelled.is_set():
                        self._cancelled(handle)
                    else:
                        admitted.append(handle)
                        free -= len(handle.requests)
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
        if self.on_admit is not None:
            self.on_admit(time.perf_counter() - handle.submitted)
        try:
            updates = self.generator.add_group(handle.requests)
        except Exception as e:  # this request's prefill failed: only it fails
            for r in handle.requests:
                self.generator.remove(r.request_id)
            handle.finished = True
            handle.on_event(ErrorEvent(f"{type(e).__name__}: {e}"))
            return
        for r in handle.requests:
            self._active[r.request_id] = handle
        for update in updates:
            self._deliver(update)
        self._report(None)

    def _drop_cancelled(self) -> None:
        for handle in {id(h): h for h in self._active.values() if h.cancelled.is_set()}.values():
            self._drop(handle)

    def _drop(self, handle: RequestHandle) -> None:
        """A cancelled request's sequences leave their slots now."""
        for r in handle.requests:
            self.generator.remove(r.request_id)
            self._active.pop(r.request_id, None)
        self._cancelled(handle)

    def _cancelled(self, handle: RequestHandle) -> None:
        handle.finished = True
        if self.on_cancel is not None:
            self.on_cancel(handle)

    def _deliver(self, update) -> None:
        handle = self._active.get(update.request_id)
        if handle is None:
            return
        if handle.cancelled.is_set():  # cancelled during the step: free the slots now, deliver nothing
            self._drop(handle)
            return
        index = handle.index[update.request_id]
        if update.events:
            handle.on_event(TokensEvent(update.events, index))
        if update.finish_reason:
            del self._active[update.request_id]
            handle.running -= 1
            handle.finished = not handle.running
            handle.on_event(DoneEvent(update.finish_reason, update.token_ids, update.text, update.stats, index))

    def _report(self, report: StepReport | None) -> None:
        if self.on_step is not None:
            self.on_step(report, len(self.generator.rows), len(self._queue))

    def _fail_all(self, message: str, include_queue: bool = False) -> None:
        handles = list({id(h): h for h in self._active.values()}.values())
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
