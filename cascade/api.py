"""The public API: ``Cascade.from_topology(path).generate(...)``."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from pydantic import ValidationError

from cascade.build import Backend, load_tokenizer, resolve_backend
from cascade.engine import Batch, Engine, Request, RequestState
from cascade.errors import RequestError, TopologyError, WorkerError
from cascade.sampling import Sampling
from cascade.stats import RequestStats
from cascade.topology import Topology, load_topology
from policies import Policy, PolicyError, make_policy
from workers.base import Worker

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass
class Generation:
    """One prompt's result. ``token_ids`` exclude the prompt; ``text`` is their decoding."""

    prompt: Prompt
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt if isinstance(self.prompt, str) else list(self.prompt),
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


class Cascade:
    """A loaded hierarchy, ready to generate. Use as a context manager or call :meth:`close`."""

    def __init__(self, topology: Topology, workers: dict[str, Worker], tokenizer=None, policy: Policy | None = None,
                 backend=None):
        self.topology = topology
        self.workers = workers
        self.tokenizer = tokenizer
        self.backend: Backend | None = backend  # what the workers run on: closed after them
        spec = topology.spec
        try:
            policy = policy or make_policy(spec.policy.name, spec.policy.params)
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
            )
        except PolicyError as exc:
            raise TopologyError(f"{topology.source}: policy.{exc}") from None

    @classmethod
    def from_topology(cls, path: str | Path, *, policy: str | Policy | None = None, device: str | None = None,
                      backend: str | None = None, address: str | None = None,
                      **policy_params: Any) -> "Cascade":
        """Load a topology file, its models and its policy (``policy`` overrides the file's).

        ``backend`` ("local" or "ray") and ``address`` (Ray only) override the file's
        ``backend`` and ``ray.address``.
        """
        topo = load_topology(path)
        name = backend or topo.spec.backend
        try:
            backend_cls = resolve_backend(name)
        except LookupError as exc:
            raise RequestError(f"backend: {exc}") from None
        pol = _policy_arg(policy, policy_params, topo.source)
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
    ) -> Generation | list[Generation]:
        """Generate for one prompt (-> a :class:`Generation`) or a list (-> a list, in order).

        A prompt is a string or a list of token ids. Unset sampling parameters come from the
        topology's ``sampling``. With several prompts and a seed, prompt ``i`` uses ``seed + i``.
        ``batch_size > 1`` runs up to that many prompts together (continuous batching: each
        level's forward pass covers all of them, and a finished prompt's place goes to the next).
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise RequestError("prompts: empty list")
        pol = _policy_arg(policy, {}, "generate")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise RequestError(f"batch_size: must be an integer >= 1, got {batch_size!r}")
        if batch_size > 1 and len(batch) > 1:
            results = self._generate_batched(batch, max_new_tokens, temperature, top_k, top_p, seed, stop, pol,
                                             batch_size)
            return results[0] if single else results
        results = []
        for i, prompt in enumerate(batch):
            state = self._start(prompt, max_new_tokens, temperature, top_k, top_p,
                                None if seed is None else seed + i)
            try:
                for _ in self._run(state, stop, pol):
                    pass
            except WorkerError as exc:
                # The authority is down: hand back what it had committed, as a result.
                state.finish_reason = "error"
                exc.partial = self._result(prompt, state, stop)
                raise
            results.append(self._result(prompt, state, stop))
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
    ) -> Iterator[str]:
        """Yield the text as it is committed. Text that could still become a stop string, or an
        incomplete UTF-8 character, is held back until it is settled."""
        self._need_tokenizer()
        state = self._start(prompt, max_new_tokens, temperature, top_k, top_p, seed)
        stops = _stop_list(stop)
        sent = 0
        for _ in self._run(state, stops, _policy_arg(policy, {}, "stream")):
            text = self._text(state.generated, stops)
            safe = len(text) if state.finish_reason else _settled(text, stops)
            if safe > sent:
                yield text[sent:safe]
                sent = safe
        text = self._text(state.generated, stops)
        if len(text) > sent:
            yield text[sent:]

    def request(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float | None = None,
                top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> RequestState:
        """A validated request, ready to join a :meth:`batch` (``batch.add(state)``)."""
        return self._start(prompt, max_new_tokens, temperature, top_k, top_p, seed)

    def batch(self, policy: str | Policy | None = None) -> Batch:
        """A continuous batch: ``add`` requests from :meth:`request` whenever you like, call
        ``step()`` to advance all of them by one speculative step (it returns what each
        committed); finished requests leave by themselves. :meth:`result` turns a finished
        request into a :class:`Generation`."""
        return Batch(self.engine, _policy_arg(policy, {}, "batch"))

    def result(self, state: RequestState, prompt: Prompt | None = None) -> Generation:
        return self._result(prompt if prompt is not None else state.request.prompt_ids, state, None)

    def _generate_batched(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop, policy,
                          batch_size) -> list[Generation]:
        states = [self._start(p, max_new_tokens, temperature, top_k, top_p, None if seed is None else seed + i)
                  for i, p in enumerate(prompts)]
        stops = _stop_list(stop)
        if stops:
            self._need_tokenizer()
        batch = Batch(self.engine, policy)
        waiting = list(states)
        try:
            while waiting or batch.active:
                while waiting and len(batch.active) < batch_size:
                    batch.add(waiting.pop(0))
                for state, _ in batch.step():
                    if stops and state.finish_reason is None and any(s in self._decode(state.generated) for s in stops):
                        state.finish_reason = "stop"
        except WorkerError as exc:
            exc.partial = [self._result(p, s, stop) for p, s in zip(prompts, states)]
            raise
        finally:
            batch.close()
        return [self._result(p, s, stop) for p, s in zip(prompts, states)]

    # -- internals -------------------------------------------------------------------------------

    def _start(self, prompt, max_new_tokens, temperature, top_k, top_p, seed) -> RequestState:
        defaults = self.topology.spec.sampling
        try:
            sampling = Sampling(
                temperature=defaults.temperature if temperature is None else temperature,
                top_k=defaults.top_k if top_k is None else top_k,
                top_p=defaults.top_p if top_p is None else top_p,
            )
        except ValidationError as exc:
            err = exc.errors()[0]
            raise RequestError(f"{err['loc'][0]}: {err['msg']} (got {err.get('input')!r})") from None
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt: empty prompt")
            ids = self._need_tokenizer().encode(prompt, add_special_tokens=False)
        else:
            ids = [int(t) for t in prompt]
        return self.engine.start(Request(ids, max_new_tokens, sampling, seed))

    def _run(self, state: RequestState, stop, policy: Policy | None) -> Iterator[list[int]]:
        stops = _stop_list(stop)
        if stops:
            self._need_tokenizer()
        for new in self.engine.run(state, policy):
            if stops and any(s in self._decode(state.generated) for s in stops):
                state.finish_reason = "stop"
                yield new
                return
            yield new

    def _result(self, prompt: Prompt, state: RequestState, stop) -> Generation:
        stops = _stop_list(stop)
        ids = list(state.generated)
        if state.finish_reason == "stop":
            # Keep the shortest prefix of tokens whose text contains a stop string.
            while len(ids) > 1 and any(s in self._decode(ids[:-1]) for s in stops):
                ids.pop()
            state.stats.new_tokens = len(ids)
        text = self._text(ids, stops) if self.tokenizer is not None else ""
        return Generation(prompt, ids, text, state.finish_reason or "length", state.stats)

    def _text(self, ids: list[int], stops: list[str]) -> str:
        text = self._decode(ids)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError("prompt: this topology has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def close(self) -> None:
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


def _policy_arg(policy, params: dict[str, Any], where: str) -> Policy | None:
    if policy is None or isinstance(policy, Policy):
        return policy
    try:
        return make_policy(policy, params)
    except PolicyError as exc:
        raise RequestError(f"policy: {exc}") from None


def _stop_list(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not isinstance(s, str) or not s for s in stops):
        raise RequestError(f"stop: stop strings must be non-empty strings, got {stop!r}")
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
