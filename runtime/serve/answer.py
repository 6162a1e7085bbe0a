"""One generation request of `specrt serve`, answered: its n choices submitted to the engine worker
as one group, their events turned into server-sent chunks or one response body.

The worker calls back from its thread; ``Answerer`` hands every event to the request's event
loop, so nothing here blocks the loop on the engine. A client that goes away (a stream closed, or
a non-streaming request's connection dropped) cancels the generation: its slots are freed at the
next step.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .openai_api import (ApiError, chat_body, chat_choice, chat_chunk, chat_logprobs, completion_body,
                         completion_choice, completion_chunk, completion_logprobs, error_body, new_id,
                         speculation_field, sse, usage, usage_chunk)
from .tools import ToolCallParser, ToolPlan
from .worker import DoneEvent, EngineUnavailableError, ErrorEvent, QueueFullError, TokensEvent


@dataclass
class Job:
    """What one API request asks the engine for."""

    ids: list  # prompt token ids
    params: list  # SamplingParams, one per choice (n)
    chat: bool  # chat.completion objects (else text_completion)
    stream: bool  # server-sent events
    t0: float  # when the request arrived (time to first token is measured from here)
    include_usage: bool = False  # streams: a last chunk with the usage
    echo: str = ""  # completions: text put before each choice's completion
    cache_scope: str | None = None  # the API key's scope ("key-<i>"): cross-request caches stay within it
    fields: dict = field(default_factory=dict)  # SequenceRequest fields the choices share: grammar, method, gamma
    tools: ToolPlan | None = None  # chat with tools: each choice's text is read as tool calls (tools.py)


@dataclass
class Choice:
    """What has been generated for one choice so far."""

    text: str = ""  # streamed text
    logprobs: list = field(default_factory=list)  # (token text, logprob, ((text, logprob), ...)) per token
    done: DoneEvent | None = None
    last_token_at: float | None = None  # for the inter-token latency histogram
    parser: ToolCallParser | None = None  # a stream with tools: its text as content and tool-call deltas

    def finish_reason(self) -> str:
        """The engine's finish reason; "tool_calls" when a call ended the answer (OpenAI's)."""
        if self.parser is not None and self.parser.calls and self.done.finish_reason == "stop":
            return "tool_calls"
        return self.done.finish_reason


class Answerer:
    """Answers jobs through ``worker``: ``await answerer(request, job)`` is the HTTP response.
    ``tokenizer`` names the logprobs' tokens; ``model`` is the id the answers carry."""

    def __init__(self, worker, metrics, model: str, tokenizer):
        self.worker, self.metrics, self.model, self.tokenizer = worker, metrics, model, tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def __call__(self, request: Request, job: Job):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(event) -> None:  # worker thread -> this request's event loop
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        try:
            handle = self.worker.submit(job.ids, job.params, on_event, job.cache_scope, **job.fields)
        except QueueFullError as e:
            raise ApiError(429, str(e), "rate_limit_error", code="queue_full") from None
        except EngineUnavailableError as e:
            raise ApiError(503, str(e), "server_error", code="engine_unavailable") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="n", code="invalid_value") from None
        streamed_tools = job.tools is not None and job.stream  # each choice's text read as it streams
        answer = _Answer(self, job, handle, [Choice(parser=ToolCallParser(job.tools) if streamed_tools else None)
                                             for _ in job.params])
        if job.stream:
            return StreamingResponse(answer.stream(events), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await answer.body(request, events)


class _Answer:
    """The state of one job being answered."""

    def __init__(self, owner: Answerer, job: Job, handle, choices: list[Choice]):
        self.owner, self.job, self.handle, self.choices = owner, job, handle, choices
        self.rid = new_id("chatcmpl" if job.chat else "cmpl")
        self.first_token = True

    # ---- events ---------------------------------------------------------------------------------
    def observe(self, event: TokensEvent) -> list[tuple]:
        """Metrics and logprob entries of a TokensEvent; returns (text, entry | None) per stream event."""
        m, choice, now = self.owner.metrics, self.choices[event.index], time.perf_counter()
        tokens = sum(e.token_id is not None for e in event.events)
        if tokens:
            if self.first_token:
                self.first_token = False
                m.ttft.observe(now - self.job.t0)
            if choice.last_token_at is not None:
                for _ in range(tokens):  # a speculative round delivers several tokens at once
                    m.inter_token.observe((now - choice.last_token_at) / tokens)
            choice.last_token_at = now
        out = []
        for e in event.events:
            entry = None
            if e.logprob is not None:
                text = self.owner.token_text
                entry = (text(e.token_id), e.logprob, tuple((text(i), lp) for i, lp in e.top_logprobs))
                choice.logprobs.append(entry)
            choice.text += e.text
            out.append((e.text, entry))
        return out

    def finish(self) -> tuple[dict, dict]:
        """(usage, speculation) once every choice is done."""
        done = [c.done for c in self.choices]
        m = self.owner.metrics
        m.prompt_tokens.inc(len(self.job.ids))
        generated = sum(len(d.token_ids) for d in done)
        m.generated_tokens.inc(generated)
        cached = done[0].stats.get("cached_tokens", 0)  # the choices share one prompt (and its cached prefix)
        return usage(len(self.job.ids), generated, cached), speculation_field([d.stats for d in done])

    def logprobs(self, entries: list, offset: int) -> dict | None:
        if self.job.params[0].logprobs is None:
            return None
        return chat_logprobs(entries) if self.job.chat else completion_logprobs(entries, offset)

    # ---- a stream -------------------------------------------------------------------------------
    def chunk(self, index: int, text: str, entries: list, finish: str | None = None, delta: dict | None = None) -> dict:
        """A chunk of choice ``index``: its new ``text`` (chat: as ``delta``, default {"content": text}) and
        logprob ``entries``."""
        job, model = self.job, self.owner.model
        offset = len(job.echo) + len(self.choices[index].text) - len(text)
        lp = self.logprobs(entries, offset) if entries else None
        if job.chat:
            if delta is None:
                delta = {"content": text} if text or entries else {}
            return chat_chunk(self.rid, model, delta, finish, index, lp)
        return completion_chunk(self.rid, model, text, finish, index, lp)

    def chunks(self, index: int, text: str, entry) -> list[dict]:
        """The chunks of one token's text: one, or with tools what the parser makes of it (content, call
        headers, argument pieces; none while it holds text back, unless logprobs must travel)."""
        entries = [entry] if entry else []
        parser = self.choices[index].parser
        if parser is None:
            return [self.chunk(index, text, entries)] if text or entry else []
        deltas = parser.feed(text) or ([{}] if entry else [])
        return [self.chunk(index, text, entries if j == 0 else [], delta=d) for j, d in enumerate(deltas)]

    async def stream(self, events: asyncio.Queue):
        job, model = self.job, self.owner.model
        try:
            for i in range(len(self.choices)):
                if job.chat:
                    yield sse(chat_chunk(self.rid, model, {"role": "assistant", "content": ""}, index=i))
                if job.echo:
                    yield sse(completion_chunk(self.rid, model, job.echo, index=i))
            while True:
                event = await events.get()
                if isinstance(event, TokensEvent):
                    for text, entry in self.observe(event):
                        for chunk in self.chunks(event.index, text, entry):
                            yield sse(chunk)
                elif isinstance(event, DoneEvent):
                    choice = self.choices[event.index]
                    choice.done = event
                    for delta in choice.parser.flush() if choice.parser else ():
                        yield sse(self.chunk(event.index, "", [], delta=delta))
                    last = self.chunk(event.index, "", [], choice.finish_reason(), delta={} if job.chat else None)
                    if not all(c.done for c in self.choices):
                        yield sse(last)
                        continue
                    use, last["speculation"] = self.finish()  # the last choice's last chunk carries the stats
                    yield sse(last)
                    if job.include_usage:
                        yield sse(usage_chunk(self.rid, model, last["object"], use))
                    yield sse("[DONE]")
                    return
                else:  # ErrorEvent: the stream has started, so the error travels as an event
                    self.owner.metrics.failed.inc()
                    yield sse(error_body(event.message, "server_error", code="engine_error"))
                    yield sse("[DONE]")
                    return
        finally:
            if not self.handle.finished:  # client went away (or the stream was closed): free the slots
                self.owner.worker.cancel(self.handle)

    # ---- one body -------------------------------------------------------------------------------
    async def body(self, request: Request, events: asyncio.Queue):
        worker = self.owner.worker

        def client_left() -> None:
            worker.cancel(self.handle)
            events.put_nowait(None)  # wake the wait below: no more events will come

        watcher = asyncio.create_task(_cancel_on_disconnect(request, client_left))
        try:
            while True:
                event = await events.get()
                if event is None:  # nobody reads the answer; 499 = "client closed request" in the logs
                    return JSONResponse(error_body("client closed the request", code="client_closed"), 499)
                if isinstance(event, TokensEvent):
                    self.observe(event)
                elif isinstance(event, DoneEvent):
                    self.choices[event.index].done = event
                    if all(c.done for c in self.choices):
                        return self.build()
                elif isinstance(event, ErrorEvent):
                    self.owner.metrics.failed.inc()
                    raise ApiError(500, event.message, "server_error", code="engine_error")
        finally:
            watcher.cancel()
            if not self.handle.finished:
                worker.cancel(self.handle)

    def build(self) -> dict:
        job, model = self.job, self.owner.model
        use, spec = self.finish()
        choices = []
        for i, c in enumerate(self.choices):
            lp = self.logprobs(c.logprobs, len(job.echo))
            if job.chat and job.tools is not None:
                choices.append(tool_choice(i, c, job.tools, lp))
            elif job.chat:
                choices.append(chat_choice(i, c.done.text, c.done.finish_reason, lp))
            else:
                choices.append(completion_choice(i, job.echo + c.done.text, c.done.finish_reason, lp))
        return (chat_body if job.chat else completion_body)(self.rid, model, choices, use, spec)


def tool_choice(index: int, choice: Choice, plan: ToolPlan, logprobs: dict | None) -> dict:
    """A finished choice of a request with tools: its text read as content and ``tool_calls``."""
    choice.parser = ToolCallParser(plan)
    choice.parser.feed(choice.done.text)
    choice.parser.flush()
    calls, content = choice.parser.calls, choice.parser.content
    return chat_choice(index, content if content.strip() or not calls else None, choice.finish_reason(), logprobs,
                       calls)


async def _cancel_on_disconnect(request: Request, cancel) -> None:
    """Wait for the client of a non-streaming request to disconnect; then cancel its generation."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel()
            return
