"""One thread owns the engine; HTTP handlers talk to it through queues.

`LLMEngine` is not thread-safe and its steps are CPU/GPU-bound, so it runs on a dedicated thread
(running it on the asyncio loop would stall every connection for a whole step). Handlers put
commands (add, abort) on a thread-safe queue; the thread takes them between steps, runs
`engine.step()`, and posts each request's outputs to that request's `asyncio.Queue` on the event
loop with `call_soon_threadsafe`. `kvpress serve` builds the engine on that same thread, so that one
thread runs all of torch's parallel work (`launch.engine_thread`).

Failure policy, innermost first:

- What a request can set is validated before it reaches this thread (sampling parameters, policy
  fields with their bounds), so a request cannot make the batch's shared work raise.
- Per-request work inside a step (a policy's compression and eviction) is guarded by the engine: if
  it raises, that request alone ends with finish reason "error" and is answered here as a failure
  (500 `engine_error`, or the error event on a stream); the rest of the batch finishes normally.
- An exception from the step itself (the batched forward pass) cannot be pinned on one request
  within its batch: it fails and aborts the requests of that step's batch (the engine's
  `requests_in_last_step()`: the prefill chunks, or the decode batch; their cache state after a half-run
  step is undefined), frees their pages, and the loop keeps serving the rest. A step is either prefill or
  decode, so requests decoding while a new prompt's prefill fails are not touched; a batch of one
  request fails exactly the request that caused it.

Nothing an HTTP request does can kill the thread.

The loop reads the engine only through its step API and its read API (`LLMEngine.stats()`,
`requests_in_last_step()`, `num_waiting`): never its pool, scheduler or plans (tests/test_layering.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvpress_ext.api.policy_spec import policy_label
from vllm_kvpress_ext.engine import LLMEngine, RequestOutput, SamplingParams
from vllm_kvpress_ext.engine.request import KVStats
from vllm_kvpress_ext.engine.stats import EngineStats
from vllm_kvpress_ext.policies import KVPolicy
from vllm_kvpress_ext.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 0.1  # how often an idle loop re-checks for shutdown
TIMINGS_ENV = "KVPRESS_LOOP_TIMINGS"  # a file the loop writes its `LoopTimings` to (JSON) when it stops


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for target, item in items:
        target.put_nowait(item)


class QueueFullError(Exception):
    """The engine's waiting queue holds `max_queue` requests already (answered 429)."""


class EngineUnavailableError(Exception):
    """The loop is not running (not started yet, or shutting down)."""


class EngineStepError(Exception):
    """The engine failed while running this request, or the server shut down under it; it was aborted and
    its pages freed. `code` is `engine_error` or `server_shutting_down`."""

    def __init__(self, message: str, code: str = "engine_error") -> None:
        super().__init__(message)
        self.code = code

    @property
    def status(self) -> int:
        """The HTTP status a client sees: the server going away is 503 (try again), an engine failure 500."""
        return 503 if self.code == SHUTTING_DOWN else 500


SHUTTING_DOWN = "server_shutting_down"


@dataclass
class LoopTimings:
    """Where the loop thread's wall time went (seconds), for profiling the server under load.

    `prefill_steps` / `decode_steps`: inside `engine.step()` (scheduling, forward pass, sampling, stops,
    detokenisation, snapshots); `decode_outputs`: the decode steps' batch sizes, summed (over
    `num_decode_steps`: the mean batch); `deliver`: turning outputs into updates and handing them to the
    event loop; `commands`: adding and aborting; `idle`: blocked waiting for a command.
    """

    prefill_steps: float = 0.0
    decode_steps: float = 0.0
    num_prefill_steps: int = 0
    num_decode_steps: int = 0
    decode_outputs: int = 0
    deliver: float = 0.0
    commands: float = 0.0
    idle: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class KVSummary:
    """A finished request's KV figures, copied out of the engine's live `KVStats`."""

    policy: str
    tokens_kept: int
    retention: float
    kv_bytes: int
    kv_bytes_peak: int
    compression_seconds: float
    tokens_full: int = 0

    @classmethod
    def of(cls, kv: KVStats | None, policy: str) -> KVSummary:
        if kv is None:
            return cls(policy, 0, 1.0, 0, 0, 0.0)
        return cls(
            policy, kv.tokens_kept, kv.retention, kv.kv_bytes, kv.kv_bytes_peak, kv.compression_seconds, kv.tokens_full
        )


@dataclass(frozen=True)
class Update:
    """A request's state after a step: every output token and the text so far."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    kv: KVSummary | None = None  # set when finished
    # For requests that asked (SamplingParams.logprobs / prompt_logprobs), in every update: the output
    # tokens' so far, and the prompt's (complete once the prefill is, i.e. from the first update on).
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None
    cached_tokens: int = 0  # prompt tokens read from a cached compressed prefix


@dataclass(frozen=True)
class Failure:
    message: str
    code: str = "engine_error"


@dataclass(frozen=True)
class PoolSnapshot:
    """What the loop last saw; handlers read it without touching the engine."""

    pages_total: int
    pages_used: int
    pages_free: int
    page_bytes: int
    running: int
    waiting: int
    running_peak: int
    steps: int
    failed_steps: int


class RequestHandle:
    """A submitted request as its HTTP handler sees it: a stream of `Update`s and an abort switch."""

    def __init__(self, owner: EngineLoop, request_id: str, prompt_tokens: int, policy: str) -> None:
        self.owner = owner
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.policy = policy
        self.finished = False
        self.queue: asyncio.Queue[Update | Failure] = asyncio.Queue()

    async def updates(self) -> AsyncIterator[Update]:
        """Updates until the finished one; raises `EngineStepError` if the engine failed on this request."""
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, Failure):
                self.finished = True
                raise EngineStepError(item.message, item.code)
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        """Abort in the engine unless already finished; idempotent and safe from any thread."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)


@dataclass
class _Add:
    handle: RequestHandle
    token_ids: list[int]
    params: SamplingParams
    policy: KVPolicy | None
    arrival: float
    future: concurrent.futures.Future[None]
    loop: asyncio.AbstractEventLoop
    sample_of: str | None = None  # another sample of the same prompt, whose compressed pages this one starts from
    compress_after: int | None = None  # the context/question boundary (`kv_prefix_tokens`)
    context_is_fallback: bool = False  # `compress_after` is a default that automatic prefix matching overrides


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Tracked:
    """Loop-thread bookkeeping for one request in the engine."""

    add: _Add
    tokens_seen: int = 0
    last_token_time: float = 0.0
    last_update: Update | None = None
    kv: KVStats | None = field(default=None, repr=False)


class EngineLoop:
    """Runs `engine` on a background thread; `submit` and `abort` are called from the event loop."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queue: int = 1024) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue[list[_Add] | _Abort | None] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._done: concurrent.futures.Future[None] | None = None  # set when the loop has returned
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._ids = itertools.count()
        self._peak = 0
        self._steps = 0
        self._failed_steps = 0
        self._prefix_seen = (0, 0)  # prefix-store hits and tokens already counted in the metrics
        self.timings = LoopTimings()
        # While a step's outputs are delivered: the updates for each event loop, posted together at the end.
        self._batch: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Update | Failure]]] | None = None
        stats = engine.stats()
        metrics.pages_total.set(stats.pages_total)
        metrics.page_bytes.set(stats.page_bytes)
        self.snapshot = self._take_snapshot(stats)
        self._publish()
        self.default_policy = policy_label(engine.default_policy)

    # ------------------------------------------------------------------ event-loop side

    def start(self, engine_thread: concurrent.futures.ThreadPoolExecutor | None = None) -> None:
        """Run the loop on a thread of its own, or on `engine_thread`'s one worker: pass the executor that built
        the engine, so that a single thread ever runs torch's parallel work (`launch.engine_thread` says why)."""
        if self._done is not None:
            raise RuntimeError("the engine loop is already running")
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._done = done

        def run() -> None:
            try:
                self._run()
            finally:
                done.set_result(None)

        if engine_thread is None:
            threading.Thread(target=run, name="kvpress-engine", daemon=True).start()
        else:
            engine_thread.submit(run)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; in-flight requests are aborted and their handlers told so."""
        self._stopping.set()
        self._commands.put(None)
        if self._done is not None:
            concurrent.futures.wait([self._done], timeout)

    def drain(self) -> None:
        """Refuse new requests (503) and let the ones in flight finish; `stop` ends what is left."""
        self._draining.set()

    @property
    def in_flight(self) -> int:
        """Requests the loop tracks (started or waiting); read from any thread."""
        return len(self._tracked)

    @property
    def alive(self) -> bool:
        running = self._done is not None and not self._done.done()
        return running and not self._stopping.is_set() and not self._draining.is_set()

    async def submit(
        self, token_ids: list[int], params: SamplingParams, policy: KVPolicy | None, arrival: float
    ) -> RequestHandle:
        """Queue a request; returns once the engine accepted it (raises what `add_request` raised, or
        `QueueFullError`)."""
        return (await self.submit_samples(token_ids, [params], policy, arrival))[0]

    async def submit_samples(
        self,
        token_ids: list[int],
        samples: list[SamplingParams],
        policy: KVPolicy | None,
        arrival: float,
        compress_after: int | None = None,
        context_is_fallback: bool = False,
    ) -> list[RequestHandle]:
        """Queue one request per sample of one prompt, as one command: the engine sees them together, so the
        later samples start from the first one's compressed prompt (engine/samples.py). Returns once the engine
        accepted them all; if it refused one, those it accepted are aborted and the refusal is raised.
        `compress_after` names the prompt's context (a cached compressed prefix, engine/prefix_store.py)."""
        if self._draining.is_set():
            raise EngineUnavailableError("the server is shutting down")
        if not self.alive:
            raise EngineUnavailableError("the engine loop is not running")
        label = policy_label(policy) if policy is not None else self.default_policy
        loop = asyncio.get_running_loop()
        adds: list[_Add] = []
        for params in samples:
            handle = RequestHandle(self, f"{uuid.uuid4().hex[:16]}-{next(self._ids)}", len(token_ids), label)
            first = adds[0].handle.request_id if adds else None
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            adds.append(
                _Add(
                    handle, token_ids, params, policy, arrival, future, loop, first, compress_after, context_is_fallback
                )
            )
        self._commands.put(adds)
        try:
            await asyncio.gather(*(asyncio.wrap_future(add.future) for add in adds))
        except BaseException:
            for add in adds:
                self.abort(add.handle.request_id)  # the adds may already have happened
            raise
        return [add.handle for add in adds]

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ------------------------------------------------------------------ loop thread

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._take_commands(block=not self.engine.has_unfinished_requests())
                    if self._stopping.is_set():
                        break
                    if self.engine.has_unfinished_requests():
                        self._step()
                except Exception as exc:
                    self._failed_steps += 1
                    logger.exception("engine step failed; failing the requests in its batch")
                    self._fail_batch(exc)
                    self._publish()
        finally:
            self._shutdown()

    def _take_commands(self, block: bool) -> None:
        start = time.perf_counter()
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            self.timings.idle += time.perf_counter() - start
            return
        got = time.perf_counter()
        self.timings.idle += got - start
        try:
            self._handle_all(command)
        finally:
            self.timings.commands += time.perf_counter() - got

    def _handle_all(self, command: list[_Add] | _Abort | None) -> None:
        while True:
            if command is None:
                return
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish()

    def _handle(self, command: list[_Add] | _Abort) -> None:
        try:
            if isinstance(command, list):
                for add in command:
                    self._add(add)
            else:
                self._abort(command.request_id)
        except Exception as exc:  # pragma: no cover - defensive: a command must never kill the loop
            logger.exception("engine loop: command %r failed", command)
            for add in command if isinstance(command, list) else []:
                if not add.future.done():
                    add.future.set_exception(exc)  # never leave a handler waiting

    def _add(self, add: _Add) -> None:
        if not add.future.set_running_or_notify_cancel():
            return  # the client gave up before we got here
        if self.engine.num_waiting >= self.max_queue:
            self.metrics.requests.labels(status="queue_full").inc()
            add.future.set_exception(
                QueueFullError(f"the server's queue is full ({self.max_queue} requests waiting); retry later")
            )
            return
        request_id = add.handle.request_id
        try:
            self.engine.add_request(
                add.token_ids,
                add.params,
                request_id=request_id,
                policy=add.policy,
                sample_of=add.sample_of,
                compress_after=add.compress_after,
                context_is_fallback=add.context_is_fallback,
            )
        except Exception as exc:
            add.future.set_exception(exc)
            return
        self._tracked[request_id] = _Tracked(add)
        self.metrics.prompt_tokens.inc(len(add.token_ids))
        add.future.set_result(None)

    def _abort(self, request_id: str) -> None:
        if self._tracked.pop(request_id, None) is None:
            return  # finished (or failed) already
        self.engine.abort(request_id)
        self.metrics.requests.labels(status="aborted").inc()

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()  # an exception fails the batch, in `_run`
        stepped = time.perf_counter()
        self._steps += 1
        now = time.monotonic()
        self._batch = {}
        try:
            finished = sum(self._deliver(out, now) for out in outputs)
        finally:
            self._flush()
        self.timings.deliver += time.perf_counter() - stepped
        stats = self._publish(finished_in_step=finished)
        if stats.last_step == "prefill":
            self.timings.prefill_steps += stepped - start
            self.timings.num_prefill_steps += 1
        else:
            self.timings.decode_steps += stepped - start
            self.timings.num_decode_steps += 1
            self.timings.decode_outputs += len(outputs)
        if not outputs and stats.running == 0:
            time.sleep(0.001)  # nothing can start: do not spin

    def _deliver(self, out: RequestOutput, now: float) -> int:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return 0  # aborted after the step began
        tracked.kv = out.kv
        count = len(out.output_token_ids)
        new = count - tracked.tokens_seen
        if new > 0:
            if tracked.tokens_seen == 0:
                self.metrics.ttft.observe(now - tracked.add.arrival)
            else:
                gap = (now - tracked.last_token_time) / new
                for _ in range(new):
                    self.metrics.itl.observe(gap)
            tracked.tokens_seen = count
            tracked.last_token_time = now
            self.metrics.generation_tokens.inc(new)
        if out.finished and out.finish_reason == "error":
            del self._tracked[out.request_id]
            self.metrics.requests.labels(status="error").inc()
            self._post(tracked, Failure(f"the engine failed while running this request ({out.error}); it was aborted"))
            return 1
        if out.finished:
            self._finish(tracked, out, out.finish_reason or "stop")
            return 1
        update = Update(
            list(out.output_token_ids), out.text, False, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs
        )
        tracked.last_update = update
        self._post(tracked, update)
        return 0

    def _finish(self, tracked: _Tracked, out: RequestOutput, reason: str) -> None:
        handle = tracked.add.handle
        del self._tracked[handle.request_id]
        kv = KVSummary.of(tracked.kv, handle.policy)
        status = reason if reason in ("stop", "length") else "aborted"
        self.metrics.requests.labels(status=status).inc()
        self.metrics.finished.labels(policy=handle.policy).inc()
        if tracked.kv is not None:
            self.metrics.retention.labels(policy=handle.policy).observe(kv.retention)
            if handle.policy != "full":
                self.metrics.compression.labels(policy=handle.policy).observe(kv.compression_seconds)
        self._post(
            tracked,
            Update(
                list(out.output_token_ids),
                out.text,
                True,
                reason,
                kv,
                out.logprobs,
                out.prompt_logprobs,
                out.cached_tokens,
            ),
        )

    def _fail_batch(self, exc: Exception) -> None:
        """Abort every request the failed step may have touched (`LLMEngine.requests_in_last_step`) and tell
        their clients."""
        affected = self.engine.requests_in_last_step()
        message = f"the engine failed while running this request ({type(exc).__name__}: {exc}); it was aborted"
        for request_id in dict.fromkeys(affected):
            try:
                self.engine.abort(request_id)
            except Exception:  # pragma: no cover - abort of a half-stepped request must not stop the loop
                logger.exception("engine loop: abort of %s failed", request_id)
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self.metrics.requests.labels(status="error").inc()
                self._post(tracked, Failure(message))

    def _post(self, tracked: _Tracked, item: Update | Failure) -> None:
        if self._batch is not None:
            self._batch.setdefault(tracked.add.loop, []).append((tracked.add.handle.queue, item))
            return
        # RuntimeError: the event loop is closed, the server is going away.
        with contextlib.suppress(RuntimeError):
            tracked.add.loop.call_soon_threadsafe(tracked.add.handle.queue.put_nowait, item)

    def _flush(self) -> None:
        """Hand a step's updates to each event loop in one wake-up instead of one per request."""
        batch, self._batch = self._batch or {}, None
        for loop, items in batch.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, items)

    def _take_snapshot(self, stats: EngineStats) -> PoolSnapshot:
        return PoolSnapshot(
            pages_total=stats.pages_total,
            pages_used=stats.pages_used,
            pages_free=stats.pages_free,
            page_bytes=stats.page_bytes,
            running=stats.running,
            waiting=stats.waiting,
            running_peak=self._peak,
            steps=self._steps,
            failed_steps=self._failed_steps,
        )

    def _publish(self, finished_in_step: int = 0) -> EngineStats:
        """Refresh the snapshot and the gauges from the engine; returns what it read.

        `finished_in_step`: requests that finished in the step just run; they held pages during it, so they
        count towards the peak of requests held at once."""
        stats = self.engine.stats()
        self._peak = max(self._peak, stats.running + finished_in_step)
        snap = self._take_snapshot(stats)
        self.snapshot = snap
        self._publish_prefix_store(stats)
        m = self.metrics
        m.pages_used.set(snap.pages_used)
        m.pages_free.set(snap.pages_free)
        m.running.set(stats.running)
        m.waiting.set(stats.waiting)
        m.running_peak.set(self._peak)
        return stats

    def _publish_prefix_store(self, stats: EngineStats) -> None:
        store = stats.prefixes
        if store is None:
            return
        m = self.metrics
        m.prefix_hits.inc(store.hits - self._prefix_seen[0])
        m.prefix_tokens.inc(store.tokens_reused - self._prefix_seen[1])
        self._prefix_seen = (store.hits, store.tokens_reused)
        m.prefix_pages.set(store.pages)
        m.prefix_entries.set(store.entries)

    def _shutdown(self) -> None:
        """Abort everything and release every waiter, so no handler hangs on a dead loop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            for add in command if isinstance(command, list) else []:
                if add.future.set_running_or_notify_cancel():
                    add.future.set_exception(EngineUnavailableError("the server is shutting down"))
        for request_id, tracked in list(self._tracked.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # pragma: no cover
                logger.exception("engine loop: abort of %s at shutdown failed", request_id)
            self._post(tracked, Failure("the server shut down before this request finished", SHUTTING_DOWN))
        self._tracked.clear()
        self._publish()
        self._report_timings()

    def _report_timings(self) -> None:
        logger.info("engine loop timings (s): %s", self.timings.as_dict())
        path = os.environ.get(TIMINGS_ENV)
        if path:
            with contextlib.suppress(OSError):
                Path(path).write_text(json.dumps(self.timings.as_dict(), indent=2) + "\n")
