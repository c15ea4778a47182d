"""The public API: ``Cascade.from_topology(path).generate(...)``."""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from cascade.build import Backend, load_tokenizer, resolve_backend
from cascade.engine import Batch, Engine, Request, RequestState
from cascade.errors import ClosedError, RequestError, TopologyError, WorkerError, quote
from cascade.stats import RequestStats, StepProvenance, cut_provenance
from cascade.topology import Topology, check_heads, load_topology
from cascade.validation import DEVICE_PATTERN, GenerationParams, check_token_ids, generation_params, normalize_prompt, normalize_prompts
from policies import Policy, PolicyError, from_spec, parse_policy_spec
from workers.base import Worker

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
# half of a UTF-16 pair, alone: a Python str can hold one, UTF-8 (and so a tokenizer) cannot
_SURROGATE = re.compile("[\ud800-\udfff]")
# why a stop string needs a tokenizer, and what to do without one
_STOP_NEEDS = "stop strings are matched in the decoded text; leave stop out, or give the topology a tokenizer"


@dataclass
class Generation:
    """One prompt's result. ``token_ids`` exclude the prompt; ``text`` is their decoding.
    ``provenance`` (with ``provenance=True``): per step, its path, blocks and where each of its
    tokens came from; the steps' tokens concatenate to ``token_ids``."""

    prompt: Prompt
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats
    provenance: list[StepProvenance] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt if isinstance(self.prompt, str) else list(self.prompt),
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
            **({} if self.provenance is None else {"provenance": [p.to_dict() for p in self.provenance]}),
        }


class Cascade:
    """A loaded hierarchy, ready to generate. Use as a context manager or call :meth:`close`.

    Every argument is validated before anything runs (:mod:`cascade.validation`): a bad value is
    one :class:`RequestError` naming the parameter. A Cascade may be shared by threads: its calls
    are serialised by one lock (``generate`` holds it to the end; ``stream`` and a :meth:`batch`'s
    ``add``/``step`` take it per step), so concurrent calls wait, and each gets the tokens it would
    get alone. After :meth:`close`, calls raise :class:`ClosedError`.
    """

    def __init__(self, topology: Topology, workers: dict[str, Worker], tokenizer=None, policy: Policy | None = None,
                 backend=None):
        self.topology = topology
        self.workers = workers
        self.tokenizer = tokenizer
        self.backend: Backend | None = backend  # what the workers run on: closed after them
        self._lock = threading.RLock()  # serialises generation: workers and policies are not thread-safe
        self._closed = False
        spec = topology.spec
        try:
            policy = policy or from_spec(spec.policy.model_dump())
            eos = set()
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos.add(int(tokenizer.eos_token_id))
            auth_worker = workers[topology.authority]
            self.engine = Engine(
                topology.graph,
                topology.authority,
                workers,
                policy,
                {lv.name: lv.sampling for lv in spec.levels},
                eos_token_ids=eos,
                context_length=getattr(auth_worker, "context_length", None),
                prefill_chunk=spec.prefill_chunk,
            )
        except PolicyError as exc:
            raise TopologyError(f"{topology.source}: policy.{exc}") from None

    @classmethod
    def from_topology(cls, path: str | Path, *, policy: str | Policy | None = None, device: str | None = None,
                      backend: str | None = None, address: str | None = None,
                      **policy_params: Any) -> "Cascade":
        """Load a topology file, its models and its policy (``policy``, a spec string such as
        ``"fixed:lookahead={tiny: 3}"``, a mapping ``{name, params}`` or a Policy, overrides the
        file's). Other keyword arguments are policy parameters: they update ``policy``'s, or the
        file's policy's when ``policy`` is not given (``from_topology(path, max_lookahead=16)``).

        ``backend`` ("local" or "ray") and ``address`` (Ray only) override the file's
        ``backend`` and ``ray.address``.
        """
        if device is not None and (not isinstance(device, str) or not re.fullmatch(DEVICE_PATTERN, device)):
            raise RequestError(f"device: must be auto, cpu or cuda:N (got {device!r})")
        topo = load_topology(path)
        name = backend or topo.spec.backend
        try:
            backend_cls = resolve_backend(name)
        except LookupError as exc:
            raise RequestError(f"backend: {exc}") from None
        check_heads(topo.spec, topo.source, backend=name)  # where feature heads can run, on this backend
        pol = _policy_arg(policy, policy_params, topo.source, topology=topo)
        tokenizer = load_tokenizer(topo)
        started = backend_cls.start(topo, address=address, device=device)
        try:
            return cls(topo, started.workers, tokenizer, pol, backend=started)
        except BaseException:
            started.close()
            raise

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        policy: str | Policy | None = None,
        batch_size: int = 1,
        coupling: str | None = None,
        provenance: bool = False,
    ) -> Generation | list[Generation]:
        """Generate for one prompt (-> a :class:`Generation`) or a list (-> a list, in order).

        A prompt is a string or a list of token ids. Unset sampling parameters come from the
        topology's ``sampling``. With several prompts and a seed, prompt ``i`` uses ``seed + i``.
        ``batch_size > 1`` runs up to that many prompts together (continuous batching: each
        level's forward pass covers all of them, and a finished prompt's place goes to the next).
        Every prompt is checked before any runs. If the authority fails, the :class:`WorkerError`
        carries ``partial``: the result so far (one prompt) or a result per prompt (a list:
        finished ones, ``finish_reason="error"`` for those in flight, ``"cancelled"`` for the rest).
        ``provenance=True`` records where each token came from (:attr:`Generation.provenance`);
        it changes no token.
        """
        params = generation_params(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, stop=stop, batch_size=batch_size, coupling=coupling,
                                   provenance=provenance)
        single, batch = normalize_prompts(prompts)
        pol = _policy_arg(policy, {}, "generate")
        with self._lock:
            self._check_open()
            states = [self._start(p, params, None if params.seed is None else params.seed + i,
                                  "prompts" if single else f"prompts[{i}]")
                      for i, p in enumerate(batch)]
            if params.stop:
                self.require_tokenizer("stop", _STOP_NEEDS)
            if params.batch_size > 1 and len(batch) > 1:
                results = self._generate_batched(batch, states, params, pol)
            else:
                results = self._generate_each(batch, states, params, pol, single)
        return results[0] if single else results

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        policy: str | Policy | None = None,
        coupling: str | None = None,
    ) -> Iterator[str]:
        """Yield the text as it is committed. Text that could still become a stop string, or an
        incomplete UTF-8 character, is held back until it is settled. The arguments are checked
        here, before the first chunk is asked for."""
        params = generation_params(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, stop=stop, coupling=coupling)
        prompt = normalize_prompt(prompt, "prompt")
        pol = _policy_arg(policy, {}, "stream")
        self._check_open()
        self.require_tokenizer("stream", "it yields text; use generate, which takes and returns token ids")
        state = self._start(prompt, params, params.seed, "prompt")  # no lock: see request
        return self._stream(state, list(params.stop or ()), pol)

    def _stream(self, state: RequestState, stops: list[str], policy: Policy | None) -> Iterator[str]:
        text = TextStream(self.tokenizer, stops)
        steps = self._run(state, text, policy)
        try:
            while True:
                with self._lock:  # one step at a time: other threads' calls interleave between steps
                    self._check_open()
                    piece = next(steps, None)
                if piece is None:
                    break
                if piece:
                    yield piece
        finally:
            with self._lock:
                steps.close()  # releases the request's caches
        rest = text.finish()
        if rest:
            yield rest

    def request(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float | None = None,
                top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                coupling: str | None = None, provenance: bool = False,
                policy: str | Policy | None = None) -> RequestState:
        """A validated request, ready to join a :meth:`batch` (``batch.add(state)``).
        ``provenance=True``: each step appends a :class:`StepProvenance` to
        ``state.provenance``. ``policy``: this request's own (it then steps apart from requests
        with another policy); unset, the batch's."""
        params = generation_params(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                   top_p=top_p, seed=seed, coupling=coupling, provenance=provenance)
        prompt = normalize_prompt(prompt, "prompt")
        pol = _policy_arg(policy, {}, "request", topology=self.topology)
        self._check_open()
        # Not under the lock: tokenizing and checking touch no worker, and a long prompt must
        # not hold up the steps of a batch another thread is running (a server's).
        state = self._start(prompt, params, params.seed, "prompt")
        state.policy = pol
        return state

    def batch(self, policy: str | Policy | None = None) -> Batch:
        """A continuous batch: ``add`` requests from :meth:`request` whenever you like, call
        ``step()`` to advance all of them by one speculative step (it returns what each
        committed); finished requests leave by themselves. :meth:`result` turns a finished
        request into a :class:`Generation`. Its ``add``, ``step`` and ``close`` take this
        Cascade's lock."""
        pol = _policy_arg(policy, {}, "batch")
        with self._lock:
            self._check_open()
            return _SerialBatch(self, pol)

    def result(self, state: RequestState, prompt: Prompt | None = None,
               stop: str | Sequence[str] | None = None) -> Generation:
        """The :class:`Generation` of a finished request (one that has left its batch).
        ``prompt``: what to report as its prompt (default: its token ids). ``stop``: the stop
        strings it ran with: its text is cut before the first, and with ``finish_reason="stop"``
        its tokens after the one that completed it are dropped (as ``generate`` does)."""
        if not isinstance(state, RequestState):
            raise RequestError(f"state: expected a RequestState from Cascade.request (got {type(state).__name__})")
        if state.finish_reason is None:
            raise RequestError("state: the request has not finished: it never ran or is still in a batch "
                               f"(got {len(state.generated)} tokens so far); step its batch until it leaves")
        stops = _stop_list(stop)
        if stops:
            self.require_tokenizer("stop", _STOP_NEEDS)
        return self._result(prompt if prompt is not None else state.request.prompt_ids, state, stops)

    def text_stream(self, stop: str | Sequence[str] | None = None) -> "TextStream":
        """A :class:`TextStream` for one request's tokens: feed it each step's tokens, it returns
        the text they settle and tells when a stop string has appeared (``stopped``). What
        :meth:`stream` and the HTTP server use. Stop strings need a tokenizer."""
        stops = _stop_list(stop)
        if stops:
            self.require_tokenizer("stop", _STOP_NEEDS)
        return TextStream(self.tokenizer, stops)

    def require_tokenizer(self, field: str = "prompt", need: str = "pass token ids instead of text"):
        """The tokenizer; a :class:`RequestError` naming ``field`` (what needed it, and ``need``:
        what to do instead) when the topology has none."""
        if self.tokenizer is None:
            raise RequestError(f"{field}: this topology has no tokenizer; {need}")
        return self.tokenizer

    def _generate_each(self, prompts, states, params: GenerationParams, policy, single: bool) -> list[Generation]:
        results: list[Generation] = []
        for prompt, state in zip(prompts, states):
            try:
                for _ in self._run(state, TextStream(self.tokenizer, params.stop) if params.stop else None, policy):
                    pass
            except WorkerError as exc:
                # The authority is down: hand back what was committed, as results.
                state.finish_reason = "error"
                for later in states[len(results) + 1:]:
                    later.finish_reason = "cancelled"
                done = [self._result(p, s, params.stop) for p, s in zip(prompts, states)]
                exc.partial = done[0] if single else done
                raise
            results.append(self._result(prompt, state, params.stop))
        return results

    def _generate_batched(self, prompts, states, params: GenerationParams, policy) -> list[Generation]:
        stops = list(params.stop or ())
        batch = Batch(self.engine, policy)
        waiting = list(states)
        texts = {state.seq_id: TextStream(self.tokenizer, stops) for state in states} if stops else {}
        try:
            while waiting or batch.active:
                while waiting and len(batch.active) < params.batch_size:
                    batch.add(waiting.pop(0))
                for state, new in batch.step():
                    if stops and state.finish_reason is None:
                        texts[state.seq_id].add(new)
                        if texts[state.seq_id].stopped:
                            state.finish_reason = "stop"
        except WorkerError as exc:
            for state in waiting:
                state.finish_reason = "cancelled"
            exc.partial = [self._result(p, s, stops) for p, s in zip(prompts, states)]
            raise
        finally:
            batch.close()
        return [self._result(p, s, stops) for p, s in zip(prompts, states)]

    # -- internals -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("cascade: this Cascade is closed; load it again with Cascade.from_topology")

    def _start(self, prompt: str | list[int], params: GenerationParams, seed: int | None, where: str) -> RequestState:
        """A started (not yet running) request for a normalised prompt; ``where`` names it in errors."""
        sampling = params.resolve(self.topology.spec.sampling)  # validated once, by generation_params
        if isinstance(prompt, str):
            tokenizer = self.require_tokenizer()
            bad = _SURROGATE.search(prompt)
            if bad is not None:  # the tokenizer would fail with a TypeError that names nothing
                raise RequestError(f"{where}: text that is not valid Unicode: a lone surrogate {bad.group()!r} at "
                                   f"character {bad.start()} (text must be encodable as UTF-8)")
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            if not ids:
                raise RequestError(f"{where}: the text encodes to no tokens (got {prompt!r})")
        else:
            ids = list(prompt)
        check_token_ids(ids, self._vocab_size(), where)
        try:
            return self.engine.start(Request(ids, params.max_new_tokens, sampling, seed, params.provenance))
        except RequestError as exc:
            msg = str(exc)
            raise RequestError(where + msg[len("prompt"):] if msg.startswith("prompt:") else msg) from None

    def _vocab_size(self) -> int | None:
        worker = self.engine.workers.get(self.topology.authority)
        return getattr(worker, "vocab_size", None)

    def _run(self, state: RequestState, text: TextStream | None, policy: Policy | None) -> Iterator[str]:
        """Step ``state`` to its end, yielding per step the text ``text`` settles ("" without
        one); a stop string that appears in it ends the request."""
        for new in self.engine.run(state, policy):
            if text is None:
                yield ""
                continue
            piece = text.add(new, final=state.finish_reason is not None)
            if text.stopped:
                state.finish_reason = "stop"  # wins over the reason the step gave
                yield piece
                return
            yield piece

    def _result(self, prompt: Prompt, state: RequestState, stop) -> Generation:
        stops = _stop_list(stop)
        ids = list(state.generated)
        if state.finish_reason == "stop":
            # Keep the shortest prefix of tokens whose text contains a stop string.
            while len(ids) > 1 and any(s in self._decode(ids[:-1]) for s in stops):
                ids.pop()
            state.stats.new_tokens = len(ids)
        text = self._text(ids, stops) if self.tokenizer is not None else ""
        steps = None if state.provenance is None else cut_provenance(state.provenance, len(ids))
        return Generation(prompt, ids, text, state.finish_reason or "length", state.stats, steps)

    def _text(self, ids: list[int], stops: list[str]) -> str:
        text = self._decode(ids)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        """Close the workers and what they run on. Idempotent; later calls raise ClosedError."""
        with self._lock:
            self._closed = True
            for w in self.workers.values():
                w.close()
            self.workers = {}
            if self.backend is not None:
                self.backend.close()
                self.backend = None

    def __enter__(self) -> "Cascade":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _policy_arg(policy, params: dict[str, Any], where: str, topology: Topology | None = None) -> Policy | None:
    """A call's ``policy`` (a spec string, a mapping ``{name, params}`` or a Policy; None: the
    cascade's own) as a Policy. ``params``, keyword arguments of ``from_topology``, update the
    spec's parameters, or those of ``topology``'s own policy when ``policy`` is None. With
    ``topology`` the policy is bound to its graph here, so that a level name the graph lacks is
    refused before any model loads."""
    try:
        if params:
            if isinstance(policy, Policy):
                raise RequestError(f"{sorted(params)[0]}: policy parameters as keywords need a policy name or "
                                   "spec, not a Policy object (build it with them)")
            if policy is None and topology is not None:
                policy = topology.spec.policy.model_dump()
            elif isinstance(policy, str):
                name, spec_params = parse_policy_spec(policy)
                policy = {"name": name, "params": spec_params}
            if not isinstance(policy, Mapping):
                raise RequestError(f"policy: expected a spec string, a mapping or a Policy, got {policy!r}")
            policy = {**policy, "params": {**(policy.get("params") or {}), **params}}
        if policy is None:
            return None
        pol = from_spec(policy)
        if topology is not None:
            pol.bind(topology.graph, topology.authority)
        return pol
    except PolicyError as exc:
        raise RequestError(f"policy: {exc}") from None


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise RequestError(f"stop: stop strings must be non-empty strings, got {quote(stop)}")
    return stops


def _settled(text: str, stops: list[str]) -> int:
    """Length of the prefix of ``text`` that no later token can change."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence so far
        end -= 1
    for s in stops:  # a tail that is a proper prefix of a stop string may still become one
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return end


class TextStream:
    """A request's text as its tokens come, decoded incrementally (one per request).

    ``add(tokens)`` returns the text that is now settled: appended to what earlier calls
    returned, it is a prefix of the text of all the tokens so far, cut before the first stop
    string; text that may still become a stop string, or an incomplete UTF-8 character, is held
    back. ``add(tokens, final=True)`` (or ``finish()``) returns the rest. Once :attr:`stopped`,
    the text is complete: later tokens add nothing.

    Each call costs what its new tokens cost, not what came before: the tokenizer decodes only
    a window ``ids[prefix:]``, where ``ids[prefix:read]`` is text already taken (the usual
    prefix/read offsets; the window starts where an earlier window ended on a whole character,
    so a decoder that treats a sequence's first token apart treats it the same in both
    decodes), and stop strings are looked for in the new text and the tail before it. The
    concatenation equals decoding all the tokens at once (``skip_special_tokens=True``).
    Without a tokenizer the text is empty.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.stopped = False  # a stop string has appeared: the text ends before it
        self._ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the last text taken; both lie on whole characters
        self._read = 0
        # the text taken so far, from character _base on: enough of what was handed out for a
        # stop string to straddle it and for _settled to see all it looks at
        self._text = ""
        self._base = 0
        self._sent = 0  # characters handed out
        longest = max((len(s) for s in self.stops), default=0)
        self._keep = longest + sum(len(s) - 1 for s in self.stops)

    def add(self, tokens: Iterable[int], final: bool = False) -> str:
        """The text ``tokens`` settle; ``final``: no more tokens come, so all the rest."""
        if self.stopped or self.tokenizer is None:
            return ""
        self._ids.extend(tokens)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if not window.startswith(prefix_text):  # a decoder that rewrites earlier text: decode it all
            self._prefix, prefix_text, window = 0, self._decode(self._ids[:self._read]), self._decode(self._ids)
            if not window.startswith(prefix_text):
                raise RuntimeError("TextStream: the tokenizer's decoding of a longer sequence does not extend "
                                   "that of its prefix; decode the whole sequence instead")
        new = window[len(prefix_text):]
        taken = len(self._text)
        text = self._text + new
        cut = self._find_stop(text, max(0, taken - self._keep))
        if cut >= 0:
            text, self.stopped = text[:cut], True
        if self.stopped or final or (new and not new.endswith("\ufffd")):
            # taken: the window ends on a whole character (or nothing follows)
            self._text, self._prefix, self._read = text, self._read, len(self._ids)
        end = len(text) if self.stopped or final else _settled(text, self.stops)
        start = self._sent - self._base
        out = text[start:end] if end > start else ""
        self._sent += len(out)
        # drop what no later call looks at (the settled part before the stop-string tail)
        drop = max(0, min(self._sent - self._base, len(self._text)) - self._keep)
        self._text, self._base = self._text[drop:], self._base + drop
        return out

    def finish(self) -> str:
        """The rest of the text (no more tokens come)."""
        return self.add((), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _find_stop(self, text: str, start: int) -> int:
        """Where the first stop string in ``text[start:]`` starts (absolute in ``text``), or -1."""
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found, default=-1)


class _SerialBatch(Batch):
    """A :class:`Batch` whose calls take its Cascade's lock, so that a batch stepped in one thread
    and ``generate`` called in another never run worker calls at the same time."""

    def __init__(self, cascade: Cascade, policy: Policy | None):
        super().__init__(cascade.engine, policy)
        self._cascade = cascade

    def add(self, state: RequestState) -> RequestState:
        if not isinstance(state, RequestState):
            raise RequestError(f"state: expected a RequestState from Cascade.request (got {type(state).__name__})")
        with self._cascade._lock:
            self._cascade._check_open()
            return super().add(state)

    def step(self) -> list[tuple[RequestState, list[int]]]:
        with self._cascade._lock:
            self._cascade._check_open()
            return super().step()

    def close(self) -> None:
        with self._cascade._lock:
            super().close()
