"""The engine loop of a server: one thread owns one :class:`~cascade.engine.Batch` and steps it.

    handlers (asyncio)                       engine thread
    Server.submit() ── waiting queue ──▶     admit up to max_num_seqs → batch.add
    Server.cancel() ── flag ──────────▶     mark cancelled → released by the next step
    Job.updates()   ◀── call_soon_threadsafe ── batch.step() → each request's new tokens

The event loop never runs a forward pass and the engine thread never touches a socket: tokens
cross over as :class:`Update` objects put into each request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. Admission is bounded: a request that finds more than
``max_queued`` others waiting (beyond the batch's free places) is refused with
:class:`Overloaded` (HTTP 429).

A request is checked and tokenized in a worker thread, outside the Cascade's lock: a long
prompt holds up neither the event loop nor a step. Long text prompts take one thread of their
own (so at most one long prompt's tokenizer memory exists at a time, and short prompts never
queue behind them), and the memory their tokenizing freed is handed back to the system. A
request names only the policies this server offers: the registered names, and the
``module:Class`` paths its operator allowed (``allow_policies``); nothing a client sends is
imported. What its policy may ask is bounded (:class:`~cascade.serve.limits.PolicyLimits`).

A worker failure (:class:`~cascade.errors.WorkerError`) ends the requests of the failing step
with an error that carries what they had committed; the loop goes on with the rest. Any other
exception kills the loop: every request in flight ends with an error, ``/health`` says 503.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import functools
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from cascade.api import Cascade, Generation, TextStream
from cascade.engine import RequestState
from cascade.errors import RequestError, WorkerError
from cascade.serve.limits import PolicyLimits
from cascade.serve.metrics import Metrics, RecordingPolicy
from cascade.stats import StepProvenance
from policies import REGISTRY, Policy, PolicyError, parse_policy_spec, resolve

log = logging.getLogger(__name__)

#: how many request-named policy specs a server keeps a (shared, learning) policy for
SPEC_POLICIES = 16
#: a text prompt at least this long (characters) is tokenized in the long prompts' thread
LONG_PROMPT_CHARS = 1 << 16


@dataclass
class Update:
    """What one engine step committed for one request. The last update of a request has
    ``finish_reason`` (cascade's: length, eos, stop, context, error, cancelled) and
    ``generation`` (the result, cut at a stop string); ``error`` says why it failed, if it did.
    ``steps``: for a request with provenance, the steps that committed ``tokens``. ``text``:
    the text this update settles (:class:`~cascade.api.TextStream`; the last update's takes
    the rest), so the updates' texts concatenate to the answer's text."""

    tokens: list[int]
    finish_reason: str | None = None
    generation: Generation | None = None
    error: str | None = None
    steps: list[StepProvenance] = field(default_factory=list)
    text: str = ""


class Overloaded(Exception):
    """Too many requests waiting; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(Exception):
    """The engine loop is not running (closed, or died on an unexpected error)."""


class Job:
    """One request between its handler and the engine thread."""

    def __init__(self, state: RequestState, prompt: Any, text: TextStream, loop: asyncio.AbstractEventLoop,
                 arrived: float):
        self.state = state
        self.prompt = prompt
        self.text = text  # decodes the committed tokens step by step (engine thread only)
        self.stops = text.stops
        self.loop = loop
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.arrived = arrived  # time.perf_counter() when it reached the server
        self.last_commit: float | None = None
        self.sent = 0  # tokens of state.generated handed over so far
        self.steps_sent = 0  # steps of state.provenance handed over so far (provenance only)
        self.cancelled = False  # set by the handler's side; read by the engine thread
        self.done = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.state.request.prompt_ids)

    def new_steps(self) -> list[StepProvenance]:
        """The provenance of the steps not handed over yet (none without provenance)."""
        steps = self.state.provenance or []
        new, self.steps_sent = steps[self.steps_sent:], len(steps)
        return new

    def push(self, update: Update) -> None:
        if update.finish_reason is not None:
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, update)
        except RuntimeError:  # the handler's event loop is gone (shutdown): nobody to tell
            pass

    async def updates(self) -> AsyncIterator[Update]:
        """The request's updates as they come, ending with the one that has ``finish_reason``."""
        while True:
            update = await self.queue.get()
            yield update
            if update.finish_reason is not None:
                return


class Server:
    """Owns one :class:`~cascade.api.Cascade` and the thread that steps its batch.

    ``policy`` overrides the topology's for the served batch. ``allow_policies``: the
    ``"module:Class"`` policies requests may name besides the registered ones (imported here,
    once: the operator is trusted, a request is not). ``policy_limits``: what a request's policy
    may ask (:class:`~cascade.serve.limits.PolicyLimits`; default: its defaults). Call
    :meth:`start` before submitting and :meth:`close` at the end (it also closes the cascade).
    """

    def __init__(self, cascade: Cascade, *, model_name: str | None = None, max_num_seqs: int = 16,
                 max_queued: int = 64, chat_template: str | None = None, policy: Policy | None = None,
                 allow_policies: Sequence[str] = (), policy_limits: PolicyLimits | None = None):
        if max_num_seqs < 1 or max_queued < 0:
            raise RequestError(f"max_num_seqs: need max_num_seqs >= 1 and max_queued >= 0, "
                               f"got {max_num_seqs}, {max_queued}")
        self.allowed_policies = _offered_policies(allow_policies)
        self.policy_limits = policy_limits or PolicyLimits()
        self.cascade = cascade
        topo = cascade.topology
        self.model_name = model_name or topo.spec.name or topo.source.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        self.max_num_seqs = max_num_seqs
        self.max_queued = max_queued
        self.chat_template = chat_template
        self.metrics = Metrics(list(topo.graph.edges))
        self._policy = RecordingPolicy(policy or cascade.engine.policy, self.metrics)
        self.batch = cascade.batch(self._policy)
        # the requests' own policies, one per spec (least recently used first): requests that
        # name the same spec share it, so they batch together and it learns from all of them
        self._spec_policies: collections.OrderedDict[str, RecordingPolicy] = collections.OrderedDict()
        self.steps = 0
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[str, Job] = {}
        self._wake = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.dead: str | None = None  # why the engine loop stopped, if it did not stop on close()
        self.authority_error: str | None = None  # the authority's last failure, until a step succeeds
        self._long_prompts = ThreadPoolExecutor(1, thread_name_prefix="cascade-long-prompts")

    # -- the handlers' side (event loop) -------------------------------------------------------

    def start(self) -> "Server":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="cascade-engine", daemon=True)
            self._thread.start()
        return self

    async def submit(self, prompt: str | Sequence[int], max_new_tokens: int, *, temperature: float | None = None,
                     top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                     stop: str | Sequence[str] | None = None, provenance: bool = False,
                     policy: str | None = None) -> Job:
        """Validate a request and queue it for the batch; the updates go to the calling event
        loop. Raises RequestError (bad input), Overloaded or Unavailable. ``provenance``: each
        update carries its steps' provenance; ``policy``: a spec string for this request. Requests
        that name the same spec (the same name and parameters) share one policy: they step
        together, apart from the served policy's group, and it learns from all of them. The
        server keeps the last :data:`SPEC_POLICIES` specs' policies."""
        arrived = time.perf_counter()
        if not self.alive:
            raise Unavailable(self.dead or "the server is shutting down")
        text = self.cascade.text_stream(stop)  # checks the stop strings (and that they can be found)
        loop = asyncio.get_running_loop()
        long = isinstance(prompt, str) and len(prompt) >= LONG_PROMPT_CHARS
        state = await loop.run_in_executor(self._long_prompts if long else None, functools.partial(
            self._request, prompt, max_new_tokens, temperature, top_k, top_p, seed, provenance, policy, long))
        if state.policy is not None:
            state.policy = self._shared_policy(policy, state.policy)
        job = Job(state, prompt, text, loop, arrived)
        with self._wake:
            free = max(0, self.max_num_seqs - len(self._running))
            if len(self._waiting) >= self.max_queued + free:
                raise Overloaded(f"{len(self._waiting)} requests are waiting (max_queued={self.max_queued})")
            self._waiting.append(job)
            self.metrics.waiting.set(len(self._waiting))
            self._wake.notify()
        return job

    def _request(self, prompt, max_new_tokens, temperature, top_k, top_p, seed, provenance, policy,
                 long: bool) -> RequestState:
        """Cascade.request (in a worker thread; it tokenizes without the Cascade's lock), for a
        policy this server offers only."""
        try:
            if policy is not None:
                self._check_policy(policy)
            return self.cascade.request(prompt, max_new_tokens, temperature, top_k, top_p, seed,
                                        provenance=provenance, policy=policy)
        finally:
            if long:
                _release_memory()

    def _check_policy(self, spec: str) -> None:
        """A request's policy spec names a policy this server offers (before anything builds it:
        building a ``module:Class`` would import the module), within :attr:`policy_limits`."""
        try:
            name, params = parse_policy_spec(spec)
        except PolicyError as exc:
            raise RequestError(f"policy: {exc}") from None
        if name not in self.allowed_policies:
            offered = sorted(REGISTRY) + sorted(p for p in self.allowed_policies if p not in REGISTRY
                                                and p not in REGISTRY.values())
            raise RequestError(f"policy: name: {name!r} is not a policy this server offers; it offers {offered} "
                               "(its operator can allow another with cascade serve --allow-policy module:Class)")
        cls = resolve(name)  # offered: imported already, at start
        if cls.Params is not None:
            try:
                params = cls.check_params(params)  # the values it would run with, defaults included
            except PolicyError:
                return  # building it says what is wrong, as for any caller
        self.policy_limits.check(params)

    def _shared_policy(self, spec: str, fresh: Policy) -> RecordingPolicy:
        """The policy of requests naming ``spec``: ``fresh`` (just built and bound from it) for
        the first, the same object for the next ones. Its plans and outcomes reach the metrics."""
        name, params = parse_policy_spec(spec)
        key = json.dumps([name, params], sort_keys=True, default=repr)
        shared = self._spec_policies.pop(key, None) or RecordingPolicy(fresh, self.metrics)
        self._spec_policies[key] = shared
        while len(self._spec_policies) > SPEC_POLICIES:
            self._spec_policies.popitem(last=False)  # requests in flight keep theirs
        return shared

    def cancel(self, job: Job) -> None:
        """The client is gone: the request leaves the batch (caches released) at the next step."""
        if not job.done:
            job.cancelled = True
            with self._wake:
                self._wake.notify()

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """Messages -> the prompt text, by the chat template (``--chat-template`` or the authority
        tokenizer's), with the generation prompt. The text is tokenized without special tokens
        added, so a template that writes BOS gets exactly one."""
        tokenizer = self.cascade.require_tokenizer("messages", "send token ids to /v1/completions")
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise RequestError("messages: this model has no chat template; start the server with "
                               "--chat-template FILE (a Jinja template) or use /v1/completions")
        try:
            return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # the template's own checks (e.g. role order) raise from Jinja
            raise RequestError(f"messages: the chat template refused them: {exc}") from None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, details): unhealthy when the loop is not running or the authority is down."""
        cached = self.cached_sequences()
        info = {"status": "ok", "model": self.model_name, "running": len(self._running),
                "waiting": len(self._waiting), "steps": self.steps, "cached_sequences": cached}
        if not self.alive:
            info["status"] = "engine loop stopped: " + (self.dead or "shutting down")
        elif self.authority_error:
            info["status"] = "authority down: " + self.authority_error
        return info["status"] == "ok", info

    def cached_sequences(self) -> dict[str, int]:
        """Per level, the sequences it holds a cache for, where the level can tell (debug)."""
        out = {}
        for name, worker in self.cascade.workers.items():
            count = worker.cached_sequences()
            if count is not None:
                out[name] = count
                self.metrics.cached.labels(level=name).set(count)
        return out

    def close(self) -> None:
        """Stop the loop, end what is in flight, close the cascade. Idempotent."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._end_all("the server is shutting down")
        self._long_prompts.shutdown(wait=False, cancel_futures=True)
        self.cascade.close()

    # -- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._admit():
                self._drop_cancelled()
                if self.batch.active:
                    self._step()
        except BaseException as exc:  # a bug, not a worker failure: nothing can be trusted now
            log.exception("engine loop died")
            self.dead = f"{type(exc).__name__}: {exc}"
            self._end_all(f"the engine loop died: {self.dead}")

    def _admit(self) -> bool:
        """Wait for work; move waiting requests into the batch while it has room. False: closing."""
        with self._wake:
            while not self._closing and not self._waiting and not self.batch.active:
                self._wake.wait()
            if self._closing:
                return False
            joining = []
            while self._waiting and len(self.batch.active) + len(joining) < self.max_num_seqs:
                job = self._waiting.popleft()
                if job.cancelled:  # gone before it got a place
                    job.push(Update([], "cancelled"))
                    self.metrics.finished.labels(finished_reason="abort").inc()
                    continue
                joining.append(job)
                self._running[job.state.seq_id] = job
            self.metrics.waiting.set(len(self._waiting))
        for job in joining:  # outside the condition: adding takes the Cascade's lock
            self.batch.add(job.state)
            self.metrics.prompt_tokens.inc(job.prompt_tokens)
        self.metrics.running.set(len(self.batch.active))
        return True

    def _drop_cancelled(self) -> None:
        # Marked finished, the request is retired by the next step, which releases its caches
        # in every level (Batch.step retires finished requests before it runs).
        for job in self._running.values():
            if job.cancelled and job.state.finish_reason is None:
                job.state.finish_reason = "cancelled"

    def _step(self) -> None:
        failure = None
        try:
            self.batch.step()
            self.authority_error = None
        except WorkerError as exc:
            failure = exc
            log.warning("level %s failed; ending the requests of its step: %s", exc.level, exc)
            if exc.level is None or exc.level == self.cascade.topology.authority:
                self.authority_error = f"level {exc.level!r}: {exc}"
        except Exception as exc:  # not a worker's own failure: trust nothing of this batch
            log.exception("engine step failed; ending every request in the batch")
            self.authority_error = f"engine step failed: {type(exc).__name__}: {exc}"
            self._restart_batch(self.authority_error)
            return
        self.steps += 1
        self._dispatch(failure)

    def _restart_batch(self, message: str) -> None:
        """End the batch's requests with an error, release their caches and start a new batch
        (the next requests then run on a clean slate; a failure to release kills the loop)."""
        self._dispatch(None)  # what was committed before the failure still reaches the clients
        jobs = list(self._running.values())
        self._running.clear()
        for job in jobs:
            job.state.finish_reason = "error"
            self.metrics.finished.labels(finished_reason="error").inc()
            job.push(Update([], "error", self.cascade.result(job.state, job.prompt, job.stops), message,
                            text=job.text.finish()))
        self.batch.close()
        self.batch = self.cascade.batch(self._policy)

    def _dispatch(self, failure: WorkerError | None) -> None:
        """Hand each request what the step committed, and its text; finish the finished ones.
        Each request costs what its new tokens cost (the text is decoded incrementally)."""
        now = time.perf_counter()
        for seq_id, job in list(self._running.items()):
            state = job.state
            new = state.generated[job.sent:]
            job.sent = len(state.generated)
            text = ""
            if new:
                self._observe_commit(job, len(new), now)
                text = job.text.add(new, final=state.finish_reason is not None)
                # as Cascade does after each step: a stop string ends the request (and wins
                # over the reason the step gave)
                if job.text.stopped:
                    state.finish_reason = "stop"
            reason = state.finish_reason
            if reason is None:
                if new:
                    job.push(Update(new, steps=job.new_steps(), text=text))
                continue
            del self._running[seq_id]
            self.metrics.e2e.observe(now - job.arrived)
            self.metrics.finished.labels(finished_reason=_REASONS.get(reason, reason)).inc()
            error = None
            if reason == "error":
                error = f"level {failure.level!r} failed: {failure}" if failure else "generation failed"
            job.push(Update(new, reason, self.cascade.result(state, job.prompt, job.stops), error,
                            job.new_steps(), text + job.text.finish()))
        self.metrics.running.set(len(self.batch.active))

    def _observe_commit(self, job: Job, count: int, now: float) -> None:
        if job.last_commit is None:
            self.metrics.ttft.observe(now - job.arrived)
        else:
            self.metrics.itl.observe(now - job.last_commit)
        job.last_commit = now
        self.metrics.generation_tokens.inc(count)

    def _end_all(self, message: str) -> None:
        """End every request still in flight with an error (shutdown, or the loop died)."""
        with self._wake:
            jobs = list(self._running.values()) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        for job in jobs:
            if not job.done:
                job.state.finish_reason = job.state.finish_reason or "error"
                job.push(Update([], "error", self.cascade.result(job.state, job.prompt, job.stops), message,
                                text=job.text.finish()))
        try:
            self.batch.close()
        except Exception:  # a broken worker must not stop the shutdown
            log.exception("closing the batch")


# cascade's finish reasons -> vLLM's request_success labels
_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "abort"}


def _offered_policies(allowed: Sequence[str]) -> frozenset[str]:
    """The policy names a request may give: the registered names and their classes' paths, and
    the operator's ``allowed`` (each resolved now, so that a bad one fails at start)."""
    if isinstance(allowed, str):
        allowed = [allowed]
    for path in allowed:
        try:
            resolve(path)
        except PolicyError as exc:
            raise RequestError(f"allow_policies: {exc}") from None
    return frozenset(REGISTRY) | frozenset(REGISTRY.values()) | frozenset(allowed)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


def _release_memory() -> None:
    """Hand free heap memory back to the system. glibc keeps what a long prompt's tokenizing
    freed in its thread's arena, so a server's memory would only ever grow with the longest
    prompts it refused; ``malloc_trim`` returns it (a no-op elsewhere)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
