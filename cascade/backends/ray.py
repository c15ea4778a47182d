"""The Ray backend: each model level runs in one Ray actor that wraps the same worker class as
in-process (a model-free n-gram level stays in the driver unless ``ray.ngram_in_driver`` is off).

Ray stays at this edge. :class:`LevelActor` is a plain class (``ray.remote`` is applied when the
actors are created) that builds the level's worker with :func:`cascade.api.build_worker`;
:class:`RayWorker` is a :class:`~workers.base.Worker` whose calls go to that actor, so the engine
does not know where a level runs. :class:`RayBackend` places the actors in one placement group,
supervises them and removes everything it created on :meth:`RayBackend.close`.

Wire cost (cascade/DESIGN.md §4). Per call the driver sends each sequence's tokens past the
engine's count of what the level holds (``Worker.hold``), as far as the actor was sent them (it
keeps the last sequence it was sent; after a restart it asks for the whole sequence once), and
the actor answers with sampling rows, not logits: warping happens next to the model and only
the nonzero entries travel, so a greedy row is one (index, value) pair. Verification needs
exactly those rows (cascade/DESIGN.md §2); nothing is rounded, so results are bit-identical to the
in-process backend. Messages are plain tuples of ints and bytes, which Ray pickles fastest
(the format: :mod:`cascade.backends.wire`). Trees travel as (tokens, parents) lists of ints: a
tree is drafted (``draft_tree``) and scored (``score_tree``, ``score_tree_probs``) in one call
each, by the actor's worker as in-process, not path by path over the wire.
A level with a stop rule gets logits instead (the rule reads the model's own distribution).

Feature heads (``kind: head``, :mod:`workers.head`) live in the actor of the level they read
(their ``features_of``), built there beside its worker over its embedding and LM head as
in-process, with no actor or bundle of their own; a head whose source runs in the driver runs
there with it. The driver's :class:`RayHeadWorker` names the head in every call to that actor
(each call says which of the actor's workers it is for) and does the engine's hand-off
(:meth:`workers.head.HeadWorker.hand_off`) in one call, inside the actor: features never cross the
wire.

Faults. Actors restart up to ``ray.max_restarts`` times and Ray re-runs the interrupted call on
the new actor, which rebuilds its cache from the full sequence (a fresh worker holds nothing,
whatever the engine says it held: ``Worker.hold`` only drops), so the request completes with the
same tokens. The engine's ``hold`` goes with a sequence's next call (:meth:`RayWorker.hold`), no
call of its own, and the wire sends the tokens past it. A level that stays down raises
:class:`~cascade.errors.WorkerError` naming it: the engine continues without a draft level and
fails with the committed prefix if it is the authority.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from cascade.backends.ray_runtime import connect, drop_private_token
from cascade.backends.wire import (Packed, WireStats, dense_nbytes, from_bytes, pack_rows, packed_nbytes, to_bytes,
                                   unpack_rows)
from cascade.build import Backend
from cascade.errors import TopologyError, WorkerError
from cascade.sampling import Sampling
from cascade.topology import LevelSpec, Topology
from policies.base import StopRule
from workers.base import Draft, Worker

log = logging.getLogger(__name__)


# -- the actor -----------------------------------------------------------------------------------

@dataclass
class LevelBuild:
    """What an actor needs to build its level's worker, and nothing more (it is pickled)."""

    level: LevelSpec
    model_path: str | None
    index: int
    source: str
    device: str | None = None
    vocab_size: int | None = None  # the authority's, for n-gram levels
    heads: list["LevelBuild"] = field(default_factory=list)  # feature heads reading this level, built beside it


def _actor_device(build: LevelBuild) -> tuple[str, str]:
    """The device inside the actor and a note saying why. Ray sets CUDA_VISIBLE_DEVICES to the
    GPUs it assigned, so ``cuda`` (or ``cuda:0``) is the first of those."""
    import ray

    wanted = build.device or build.level.device
    gpu_ids = ray.get_gpu_ids()
    if gpu_ids and wanted == "auto":
        wanted = "cuda"
    if wanted.startswith("cuda") and not torch.cuda.is_available():
        return "cpu", f"GPU ids {gpu_ids} assigned but CUDA is not available: running on CPU"
    if wanted == "auto":
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    return wanted, f"running on {wanted} (GPU ids {gpu_ids})"


class LevelActor:
    """One level's worker inside a Ray actor, with the feature heads that read it. Plain class:
    ``ray.remote`` is applied at creation. Every call may name the level it is for (``level``:
    the actor's own by default, or one of its heads); each keeps its own last sequences."""

    def __init__(self, build: LevelBuild, num_threads: int = 1):
        from cascade.build import build_head, build_worker

        torch.set_num_threads(max(1, num_threads))
        self.build = build
        device, self.device_note = _actor_device(build)
        build = dataclasses.replace(build, device=device)
        if device == "cpu" and self.device_note.startswith("GPU ids"):
            log.warning("level %s: %s", build.level.name, self.device_note)
        self.failed: TopologyError | None = None
        self.workers: dict[str, Worker] = {}  # the level's worker, then its heads'
        try:
            self.worker = build_worker(build.level, build.model_path, build.index, build.source, build.device,
                                       build.vocab_size)
            self.workers[build.level.name] = self.worker
            for head in build.heads:  # over this worker's own modules, as build_workers does in process
                self.workers[head.level.name] = build_head(head.level, head.model_path, head.index, head.source,
                                                           self.worker)
        except TopologyError as exc:
            # Raised from info() instead: an error in an actor's constructor reaches the driver
            # as ActorDiedError, whose message is all that is left of it.
            self.worker, self.failed = None, exc
        # per level, the last sequence sent for each seq_id
        self.tokens: dict[str, dict[str, list[int]]] = {name: {} for name in self.workers}
        self._samplings: dict[tuple, Sampling] = {}  # the samplings seen, by their dumped fields

    def info(self, level: str | None = None) -> dict[str, Any]:
        import ray

        if self.failed is not None:
            raise self.failed
        worker = self._worker(level)
        return {
            "level": level or self.build.level.name,
            "actor_of": self.build.level.name,  # the level whose actor this is
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_available": torch.cuda.is_available(),
            "device": str(getattr(worker, "device", "cpu")),
            "device_note": self.device_note,
            "vocab_size": worker.vocab_size,
            "context_length": getattr(worker, "context_length", None),
            "can_score": worker.can_score,
            "drafts_trees": worker.drafts_trees,
        }

    def _worker(self, level: str | None) -> Worker:
        return self.workers[level or self.build.level.name]

    def _sequences(self, seq_ids, keeps, suffixes, held, level: str | None = None) -> list[list[int]] | None:
        """Rebuild the full sequences from (kept prefix length, new tokens), and tell the worker
        what the engine says it holds of them (``held``: ``{seq_id: positions}``, Worker.hold);
        None: resend all."""
        sent = self.tokens[level or self.build.level.name]
        out = []
        for seq, keep, suffix in zip(seq_ids, keeps, suffixes):
            known = sent.get(seq, [])
            if keep > len(known):
                return None  # this actor restarted (or never saw the sequence)
            tokens = known[:keep] + suffix
            sent[seq] = tokens
            out.append(tokens)
        self._hold(level, held)
        return out

    def _hold(self, level: str | None, held: dict[str, int]) -> None:
        if held:
            self._worker(level).hold(list(held), list(held.values()))

    def _sampling(self, fields: dict[str, Any]) -> Sampling:
        """The :class:`Sampling` a call sent as ``Sampling.model_dump()``, validated once per kind."""
        key = tuple(fields.items())
        found = self._samplings.get(key)
        if found is None:
            found = self._samplings[key] = Sampling.model_validate(fields)
        return found

    def score(self, seq_ids, keeps, suffixes, held, num_positions, level: str | None = None):
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        return [pack_rows(r) for r in self._worker(level).score(seq_ids, seqs, num_positions)]

    def score_probs(self, seq_ids, keeps, suffixes, held, num_positions, sampling: dict[str, Any],
                    level: str | None = None):
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        rows = self._worker(level).score_probs(seq_ids, seqs, num_positions, self._sampling(sampling))
        return [pack_rows(r) for r in rows]

    def draft(self, seq_ids, keeps, suffixes, held, max_tokens, sampling: dict[str, Any], uniforms,
              stop: StopRule | None, level: str | None = None):
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        uniforms = [from_bytes(u, torch.float64) for u in uniforms]
        drafts = self._worker(level).draft(seq_ids, seqs, max_tokens, self._sampling(sampling), uniforms, stop)
        # (tokens, packed rows, forward passes, any further fields of Draft by name)
        return [(d.tokens, pack_rows(d.probs), d.forward_passes,
                 {f.name: getattr(d, f.name) for f in dataclasses.fields(d)[3:]}) for d in drafts]

    def score_tree(self, seq_ids, keeps, suffixes, held, trees, level: str | None = None):
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        return [pack_rows(r) for r in self._worker(level).score_tree(seq_ids, seqs, trees)]

    def score_tree_probs(self, seq_ids, keeps, suffixes, held, trees, sampling: dict[str, Any],
                         level: str | None = None):
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        rows = self._worker(level).score_tree_probs(seq_ids, seqs, trees, self._sampling(sampling))
        return [pack_rows(r) for r in rows]

    def draft_tree(self, seq_ids, keeps, suffixes, held, widths, level: str | None = None):
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        # (tokens, parents) per sequence: lists of ints, as Worker.draft_tree returns them
        grown = self._worker(level).draft_tree(seq_ids, seqs, widths)
        return [(list(tokens), list(parents)) for tokens, parents in grown]

    def hand_features(self, seq_ids, keeps, suffixes, held, ends, source_held, level: str | None = None):
        """The engine's hand-off to the head ``level`` (:meth:`workers.head.HeadWorker.hand_off`), from
        this actor's own worker, here: the indices of the sequences whose features it asked for
        (after a restart the source recomputes what it no longer holds)."""
        seqs = self._sequences(seq_ids, keeps, suffixes, held, level)
        if seqs is None:
            return None
        head = self._worker(level)
        if head.features_of != self.build.level.name:
            raise ValueError(f"hand_features: {level!r} is not a head reading {self.build.level.name!r}")
        self._hold(None, source_held)
        return [int(b) for b in head.hand_off(self.worker, seq_ids, seqs, ends)]

    def release(self, seq_ids, level: str | None = None):
        held = self.tokens[level or self.build.level.name]
        for s in seq_ids:
            held.pop(s, None)
        self._worker(level).release(seq_ids)

    def close(self):
        for worker in self.workers.values():
            worker.close()


# -- the proxy -----------------------------------------------------------------------------------

class RayWorker(Worker):
    """A :class:`Worker` whose calls run in a :class:`LevelActor` (each naming the level ``name``:
    the actor's own, or for :class:`RayHeadWorker` a head in it). Waits out restarts up to
    ``call_timeout_s`` per call; a level that stays down raises :class:`WorkerError` naming it."""

    def __init__(self, name: str, actor, info: dict[str, Any], call_timeout_s: float = 300.0):
        self.name = name
        self.actor = actor
        self.info = info
        self.vocab_size = int(info["vocab_size"])
        self.context_length = info.get("context_length")
        self.can_score = bool(info.get("can_score", True))
        self.drafts_trees = bool(info.get("drafts_trees", self.can_score))
        self.call_timeout_s = call_timeout_s
        self.wire = WireStats()
        self._held: dict[str, int] = {}  # what the engine says the level holds, for the next call (hold)
        self._sent: dict[str, int] = {}  # how many tokens of each sequence the actor has: its last call's
        self._handed: dict[str, int] = {}  # a hand-off's sequences, which the next call continues (RayHeadWorker)

    # Worker interface ------------------------------------------------------------------------

    def score(self, seq_ids, token_ids, num_positions) -> list[torch.Tensor]:
        packed = self._call_seqs("score", seq_ids, token_ids, list(num_positions))
        return self._unpack_rows(packed)

    def score_probs(self, seq_ids, token_ids, num_positions, sampling: Sampling) -> list[torch.Tensor]:
        packed = self._call_seqs("score_probs", seq_ids, token_ids, list(num_positions), sampling.model_dump())
        return self._unpack_rows(packed)

    def draft(self, seq_ids, token_ids, max_tokens, sampling: Sampling, uniforms, stop: StopRule | None = None
              ) -> list[Draft]:
        raw = [to_bytes(u.to(torch.float64)) for u in uniforms]
        self.wire.sent += sum(len(u) for u in raw)
        answers = self._call_seqs("draft", seq_ids, token_ids, list(max_tokens), sampling.model_dump(), raw,
                                  stop)
        drafts = []
        for tokens, packed, passes, more in answers:
            self.wire.received += packed_nbytes(packed) + 8 * (len(tokens) + 1 + len(more))
            self.wire.rows_dense += dense_nbytes(packed)
            drafts.append(Draft(tokens, unpack_rows(packed), passes, **more))
        return drafts

    def score_tree(self, seq_ids, token_ids, trees) -> list[torch.Tensor]:
        """:meth:`Worker.score_tree` in one call to the actor, which scores the trees as its
        worker does in-process (one forward pass where the model allows it)."""
        packed = self._call_seqs("score_tree", seq_ids, token_ids, self._wire_trees(trees))
        return self._unpack_rows(packed)

    def score_tree_probs(self, seq_ids, token_ids, trees, sampling: Sampling) -> list[torch.Tensor]:
        packed = self._call_seqs("score_tree_probs", seq_ids, token_ids, self._wire_trees(trees),
                                 sampling.model_dump())
        return self._unpack_rows(packed)

    def draft_tree(self, seq_ids, token_ids, widths) -> list[tuple[list[int], list[int]]]:
        """:meth:`Worker.draft_tree` in one call: the actor grows the trees depth by depth next to
        the model and sends back only their (tokens, parents)."""
        widths = [[int(w) for w in ws] for ws in widths]
        if not any(widths):  # no depth to grow anywhere: empty trees, as in-process, without a call
            return [([], []) for _ in widths]
        self.wire.sent += sum(4 * len(w) + 8 for w in widths)
        grown = self._call_seqs("draft_tree", seq_ids, token_ids, widths)
        self.wire.received += sum(4 * (len(tokens) + len(parents)) + 8 for tokens, parents in grown)
        return [(list(tokens), list(parents)) for tokens, parents in grown]

    def hold(self, seq_ids, held) -> None:
        """Sent with the sequences' next call (no call of its own): the actor's worker holds them first."""
        self._held.update(zip(seq_ids, (int(n) for n in held)))

    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self._sent.pop(s, None)
            self._held.pop(s, None)
            self._handed.pop(s, None)
        try:  # fire and forget: a dead actor has nothing left to release
            self.actor.release.options(max_task_retries=0).remote(list(seq_ids), level=self.name)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        import ray

        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    # internals --------------------------------------------------------------------------------

    def _unpack_rows(self, packed: list[Packed]) -> list[torch.Tensor]:
        self.wire.received += sum(packed_nbytes(p) for p in packed)
        self.wire.rows_dense += sum(dense_nbytes(p) for p in packed)
        return [unpack_rows(p) for p in packed]

    def _wire_trees(self, trees) -> list[tuple[list[int], list[int]]]:
        """Trees as (tokens, parents) lists of ints, checked (:func:`workers.trees.as_tree`), for
        the wire; their bytes are counted as sent."""
        from workers.trees import as_tree

        out = [as_tree(t) for t in trees]
        self.wire.sent += sum(4 * 2 * len(tokens) + 8 for tokens, _ in out)
        return out

    def _call_seqs(self, method: str, seq_ids, token_ids, *args):
        """Call ``method`` sending each sequence as (kept prefix length, new tokens); if the actor
        does not hold the prefix (it restarted), send the whole sequences once more.

        What is kept is the engine's count of what the level holds (:meth:`hold`), as far as the
        actor was sent the sequence: a level also holds the positions it drafted, or scored in a
        tree, whose tokens it was never sent. Right after a hand-off the call continues the
        sequence handed over (:meth:`RayHeadWorker.hand_off`). No token list is compared."""
        seq_ids = list(seq_ids)
        held = {s: self._held.pop(s) for s in seq_ids if s in self._held}
        keeps = [self._handed.pop(s) if s in self._handed else min(held.get(s, 0), self._sent.get(s, 0))
                 for s in seq_ids]
        for attempt in range(2):
            suffixes = [list(t[k:]) for k, t in zip(keeps, token_ids)]  # a few small ints: a list pickles fastest
            self.wire.sent += sum(4 * len(a) + 8 for a in suffixes) + 8 * (len(seq_ids) + len(held)) + 24
            try:
                result = self._call(method, seq_ids, keeps, suffixes, held, *args)
            except WorkerError:
                # The call may still run late on the actor and change what it holds: next
                # time, send the whole sequences.
                for s in seq_ids:
                    self._sent.pop(s, None)
                for s, n in held.items():  # said again with the next call
                    self._held.setdefault(s, n)
                raise
            if result is not None:
                self._sent.update(zip(seq_ids, (len(t) for t in token_ids)))
                return result
            self.wire.resyncs += 1
            keeps = [0] * len(seq_ids)
        raise WorkerError(f"level {self.name!r}: the actor lost the sequence twice in a row", level=self.name)

    def _call(self, method: str, *args):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        self.wire.calls += 1
        ref = getattr(self.actor, method).remote(*args, level=self.name)
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except GetTimeoutError:
            ray.cancel(ref)
            raise WorkerError(
                f"level {self.name!r}: no answer to {method} within {self.call_timeout_s:g} s "
                "(actor down or restarting)", level=self.name) from None
        except RayActorError as exc:
            # Ray restarts the actor and re-runs the call itself while restarts are left; this
            # is what remains when it gave up.
            raise WorkerError(f"level {self.name!r}: actor died and was not restarted: "
                              f"{type(exc).__name__}", level=self.name) from None


class RayHeadWorker(RayWorker):
    """A feature head (``kind: head``) living in the actor of the level it reads (``features_of``):
    its calls go to that actor naming the head, with its own sent sequences and wire stats.
    :meth:`hand_off` is the engine's hand-off in one remote call: the actor hands its own worker's
    features to the head, so they never cross the wire. The actor is its source's: :meth:`close`
    leaves it to that level."""

    can_score = False

    def __init__(self, name: str, actor, info: dict[str, Any], features_of: str, call_timeout_s: float = 300.0):
        super().__init__(name, actor, info, call_timeout_s)
        self.features_of = features_of

    def score(self, seq_ids, token_ids, num_positions):
        raise TypeError("a feature head cannot verify; it can only propose")

    def score_probs(self, seq_ids, token_ids, num_positions, sampling: Sampling):
        raise TypeError("a feature head cannot verify; it can only propose")

    def hand_off(self, source: Worker, seq_ids, token_ids, ends) -> list[int]:
        """:meth:`workers.head.HeadWorker.hand_off` inside the actor: sends the sequences' new
        tokens and where their features end; ``source`` must be the proxy of the same actor.
        The indices of the sequences the source was asked for features."""
        if getattr(source, "actor", None) is not self.actor:
            other = getattr(source, "name", source)
            raise ValueError(f"level {self.name!r}: a feature head under Ray takes the features of the level "
                             f"whose actor it lives in ({self.features_of!r}), not of {other!r}")
        ends = [int(e) for e in ends]
        seq_ids = list(seq_ids)
        self._handed = {}  # one a call never followed (a tree with no depth to grow)
        held = {s: self._held.get(s, 0) for s in seq_ids}  # the engine's count of what the head holds of them
        # What the source computes from (Engine._hand_features): past it the engine's record now
        # shows the positions computed here, whose tokens the source's own proxy never sent.
        source_held, source._held = source._held, {}
        for s, n in source_held.items():
            source._sent[s] = min(source._sent.get(s, 0), n)
        self.wire.sent += 4 * len(ends) + 8 * len(source_held)
        asked = self._call_seqs("hand_features", seq_ids, token_ids, ends, source_held)
        self.wire.received += 4 * len(asked) + 8
        # The engine's next call on the head drafts from these sequences (and on): nothing to
        # resend. Past that call the engine's count is what holds (the sequences handed over may
        # roll back before the head's record shows them).
        self._handed = {s: len(t) for s, t in zip(seq_ids, token_ids)}
        self._sent.update(held)
        return list(asked)

    def close(self) -> None:
        self._sent.clear()  # the actor is its source level's, closed with it


# -- placement and lifecycle ---------------------------------------------------------------------

def plan_bundles(levels: Sequence[LevelSpec]) -> tuple[list[dict[str, float]], list[int]]:
    """Placement-group bundles for the levels, and each level's bundle index.

    Levels asking for a fraction of a GPU share a bundle of one GPU (first fit), so that they
    share one device; every other level gets a bundle of its own.
    """
    bundles: list[dict[str, float]] = []
    index: list[int] = []
    gpu_used: dict[int, float] = {}  # bundle of fractional-GPU levels -> GPU fraction taken
    for level in levels:
        r = level.resources
        want = {"CPU": r.num_cpus, **r.custom}
        if 0 < r.num_gpus < 1:
            shared = next((b for b, used in gpu_used.items() if used + r.num_gpus <= 1 + 1e-9), None)
            if shared is None:
                bundles.append({"GPU": 1.0})
                shared = len(bundles) - 1
                gpu_used[shared] = 0.0
            gpu_used[shared] += r.num_gpus
            for k, v in want.items():
                bundles[shared][k] = bundles[shared].get(k, 0.0) + v
            index.append(shared)
            continue
        bundles.append({**want, **({"GPU": r.num_gpus} if r.num_gpus else {})})
        index.append(len(bundles) - 1)
    # Ray rejects zero-sized resources in a bundle; a level asking for nothing gets a sliver.
    for b in bundles:
        for k in [k for k, v in b.items() if v == 0]:
            del b[k]
        if not b:
            b["CPU"] = 0.01
    return bundles, index


def in_driver_levels(topo: Topology) -> set[str]:
    """Names of the levels that run in the driver process, not in an actor (``ray.ngram_in_driver``,
    ``ray.in_driver``, and the feature heads of levels that run there)."""
    spec = topo.spec.ray
    names = {lv.name for lv in topo.spec.levels if lv.kind == "ngram" and spec.ngram_in_driver}
    names |= {n for n in spec.in_driver if topo.spec.level(n).kind != "head"}
    # a head runs where its source runs (cascade.topology.check_heads refuses it elsewhere)
    return names | {lv.name for lv in topo.spec.levels if lv.kind == "head" and lv.features_of in names}


def actor_levels(topo: Topology) -> list[tuple[int, LevelSpec]]:
    """The levels that get an actor each, with their index in the topology: all but those in
    the driver and the feature heads (which live in their source's actor)."""
    in_driver = in_driver_levels(topo)
    return [(i, lv) for i, lv in enumerate(topo.spec.levels) if lv.name not in in_driver and lv.kind != "head"]


def level_bundles(topo: Topology) -> list[dict[str, float]]:
    """The bundles of the placement group one cascade of ``topo`` asks for (its actors' levels)."""
    return plan_bundles([lv for _, lv in actor_levels(topo)])[0]


def private_cpus(topo: Topology, replicas: int = 1, replica_cpus: float = 0.0) -> int:
    """Logical CPUs a private runtime declares for ``replicas`` cascades of ``topo``, each with a
    process of its own holding ``replica_cpus`` (a Ray Serve replica; 0 for the driver) and a
    placement group of one bundle per level actor; never fewer than the machine's cores.

    Declaring more CPUs than the machine has is deliberate: the levels of a cascade compute one
    at a time, so on one machine they can share its cores; declaring fewer would leave a
    placement group that is never placed (and, under Ray Serve, a replica that never starts).
    """
    per_cascade = replica_cpus + sum(b.get("CPU", 0.0) for b in level_bundles(topo))
    return max(os.cpu_count() or 1, math.ceil(replicas * per_cascade - 1e-9))


def unplaceable(bundles: Sequence[dict[str, float]], strategy: str, timeout_s: float) -> str:
    """Why a placement group was not placed: the bundles asked for against what the cluster has."""
    import ray

    asked = {k for b in bundles for k in b}

    def shown(resources: dict[str, float]) -> dict[str, float]:
        # node:<ip> markers, placement groups' own resources and memory in bytes are noise
        # unless a bundle asked for them
        return {k: round(v, 2) for k, v in sorted(resources.items())
                if k in asked or not (k.startswith("node:") or k in ("memory", "object_store_memory")
                                      or re.search(r"_group_(\d+_)?[0-9a-f]{16,}$", k))}

    total = ray.cluster_resources()
    missing = sorted(k for k in asked if k not in total)
    return (f"the cluster cannot place the bundles {list(bundles)} ({strategy}) within {timeout_s:g} s "
            f"(ray.placement_timeout_s); the cluster has {shown(total)}, available now "
            f"{shown(ray.available_resources())}" + (f"; no node has {', '.join(missing)}" if missing else ""))


@dataclass
class RayBackend(Backend):
    """The actors of one :class:`~cascade.api.Cascade`, their placement group and, if cascade
    started Ray itself, that runtime. :meth:`close` removes exactly what it created."""

    workers: dict[str, Worker]  # RayWorker for every level, n-gram levels aside (ray.ngram_in_driver)
    placement_group: Any
    owns_runtime: bool
    actors: dict[str, Any] = field(default_factory=dict)  # by level name, heads aside
    heads: dict[str, str] = field(default_factory=dict)  # head level -> the level whose actor it lives in
    private_token: bool = False  # this process set RAY_AUTH_TOKEN for its private runtime

    @classmethod
    def start(cls, topo: Topology, address: str | None = None, device: str | None = None) -> "RayBackend":
        import ray

        spec = topo.spec.ray
        source = "the address argument / --address" if address else f"{topo.source}: ray.address"
        owns, private_token = connect(address or spec.address, spec.namespace, private_cpus(topo), source)
        backend = cls({}, None, owns, private_token=private_token)
        try:
            backend._place(topo, device)
        except BaseException:
            backend.close()
            raise
        return backend

    def _place(self, topo: Topology, device: str | None) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from cascade.build import build_head, build_worker, check_vocab_sizes, level_model_path

        spec = topo.spec.ray
        everything = list(enumerate(topo.spec.levels))
        in_driver = in_driver_levels(topo)
        levels = actor_levels(topo)
        heads_of: dict[str, list[LevelBuild]] = {}  # source level -> the heads its actor builds
        for i, lv in everything:
            if lv.kind == "head" and lv.name not in in_driver:
                heads_of.setdefault(lv.features_of, []).append(
                    LevelBuild(lv, level_model_path(topo, lv), i, topo.source))
                self.heads[lv.name] = lv.features_of
        if not levels:
            raise TopologyError(f"{topo.source}: ray.in_driver: every level would run in the driver; "
                                "use backend: local")
        tag = uuid.uuid4().hex[:8]
        bundle_of = self._reserve(topo, levels, tag)
        actor_cls = ray.remote(LevelActor)

        def create(i: int, level: LevelSpec, vocab: int | None):
            r = level.resources
            build = LevelBuild(level, level_model_path(topo, level), i, topo.source, device, vocab,
                               heads_of.get(level.name, []))
            return actor_cls.options(
                name=f"cascade-{tag}-{level.name}",
                num_cpus=r.num_cpus, num_gpus=r.num_gpus, resources=dict(r.custom) or None,
                max_restarts=spec.max_restarts, max_task_retries=spec.max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, bundle_of[i]),
            ).remote(build, max(1, int(r.num_cpus)))

        # Model levels first (they load in parallel; the driver's while the actors load), then
        # n-gram levels with the authority's vocabulary.
        infos: dict[str, dict] = {}
        for i, level in levels:
            if level.kind != "ngram":
                self.actors[level.name] = create(i, level, None)
        workers: dict[str, Worker] = {
            lv.name: build_worker(lv, level_model_path(topo, lv), i, topo.source, device)
            for i, lv in everything if lv.name in in_driver and lv.kind not in ("ngram", "head")}
        for i, lv in everything:  # heads of levels in the driver: beside them, as in process
            if lv.name in in_driver and lv.kind == "head":
                workers[lv.name] = build_head(lv, level_model_path(topo, lv), i, topo.source, workers[lv.features_of])
        self._collect(infos, spec.start_timeout_s)
        vocab = infos[topo.authority]["vocab_size"] if topo.authority in infos else workers[topo.authority].vocab_size
        for i, level in levels:
            if level.kind == "ngram":
                self.actors[level.name] = create(i, level, vocab)
        self._collect(infos, spec.start_timeout_s)
        # the heads, already built in their sources' actors
        refs = {head: self.actors[source].info.remote(level=head) for head, source in self.heads.items()}
        infos.update(zip(refs, ray.get(list(refs.values()), timeout=spec.start_timeout_s)))
        workers.update({lv.name: build_worker(lv, None, i, topo.source, None, vocab)
                        for i, lv in everything if lv.name in in_driver and lv.kind == "ngram"})
        check_vocab_sizes(topo, {**{name: info["vocab_size"] for name, info in infos.items()},
                                 **{name: w.vocab_size for name, w in workers.items()}})
        for name, info in infos.items():
            if name in self.heads:
                log.info("level %s: in the actor of %s (pid %s)", name, self.heads[name], info["pid"])
                workers[name] = RayHeadWorker(name, self.actors[self.heads[name]], info, self.heads[name],
                                              spec.call_timeout_s)
                continue
            log.info("level %s: actor pid %s, %s", name, info["pid"], info["device_note"])
            workers[name] = RayWorker(name, self.actors[name], info, spec.call_timeout_s)
        self.workers = {lv.name: workers[lv.name] for _, lv in everything}  # in topology order

    def _reserve(self, topo: Topology, levels: list[tuple[int, LevelSpec]], tag: str) -> dict[int, int]:
        """Create the placement group for the actors' ``levels`` and wait until it is placed;
        each level's bundle, by the level's index in the topology."""
        import ray
        from ray.util.placement_group import placement_group

        spec = topo.spec.ray
        bundles, bundle_of = plan_bundles([lv for _, lv in levels])
        self.placement_group = placement_group(bundles, strategy=spec.placement_strategy,
                                               name=f"cascade-{tag}")
        try:
            ray.get(self.placement_group.ready(), timeout=spec.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TopologyError(f"{topo.source}: levels[*].resources: "
                                + unplaceable(bundles, spec.placement_strategy, spec.placement_timeout_s)) from None
        return {i: b for (i, _), b in zip(levels, bundle_of)}

    def _collect(self, infos: dict[str, dict], timeout: float) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        pending = {name: a.info.remote() for name, a in self.actors.items() if name not in infos}
        deadline = time.monotonic() + timeout
        for name, ref in pending.items():
            try:
                infos[name] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except GetTimeoutError:
                raise WorkerError(f"level {name!r}: actor did not start within {timeout:g} s "
                                  "(ray.start_timeout_s)", level=name) from None
            except RayTaskError as exc:  # the worker's constructor raised (e.g. a TopologyError)
                cause = exc.cause if isinstance(exc.cause, Exception) else None
                if isinstance(cause, TopologyError):
                    raise cause from None
                raise WorkerError(f"level {name!r}: actor failed to start: {exc}", level=name) from None
            except RayActorError as exc:
                raise WorkerError(f"level {name!r}: actor failed to start: {exc}", level=name) from None

    def info(self) -> dict[str, dict[str, Any]]:
        """Each level's actor as it reports itself now (pid, GPU ids, device and why); a head's is
        its source's actor (``actor_of``)."""
        import ray

        out = {name: ray.get(a.info.remote()) for name, a in self.actors.items()}
        out.update({head: ray.get(self.actors[source].info.remote(level=head)) for head, source in self.heads.items()})
        return out

    def reset_wire_stats(self) -> None:
        for w in self.workers.values():
            if isinstance(w, RayWorker):
                w.wire = WireStats()

    def wire_stats(self) -> WireStats:
        total = WireStats()
        for w in self.workers.values():
            if not isinstance(w, RayWorker):
                continue
            for f in dataclasses.fields(WireStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(w.wire, f.name))
        return total

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors, self.heads = {}, {}
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
            self.placement_group = None
        if self.owns_runtime:
            ray.shutdown()
            self.owns_runtime = False
        if self.private_token:
            drop_private_token()
            self.private_token = False
