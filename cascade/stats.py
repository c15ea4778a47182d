"""Per-request statistics: recorded by the engine, rendered by the CLI."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class LevelStats:
    forward_passes: int = 0
    seconds: float = 0.0  # wall time spent in this level's worker calls, as the engine saw it
    tokens_proposed: int = 0  # tokens this level handed up to its verifier
    early_stops: int = 0  # blocks this level ended early on the policy's stop rule


@dataclass
class EdgeStats:
    blocks: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)  # [j]: blocks with a token at j
    examined_by_position: list[int] = field(default_factory=list)  # [j]: of those, with 0..j-1 accepted
    accepted_by_position: list[int] = field(default_factory=list)  # [j]: of those, accepted
    # trees (a tree's block counts its depth as proposed): candidates scored, and [r]: accepted
    # tokens that were their parent's r-th candidate (0: the proposer's own first choice)
    tree_nodes: int = 0
    accepted_by_rank: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def merge(self, other: "EdgeStats") -> "EdgeStats":
        self.blocks += other.blocks
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.tree_nodes += other.tree_nodes
        for mine, theirs in ((self.proposed_by_position, other.proposed_by_position),
                             (self.examined_by_position, other.examined_by_position),
                             (self.accepted_by_position, other.accepted_by_position),
                             (self.accepted_by_rank, other.accepted_by_rank)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for j, c in enumerate(theirs):
                mine[j] += c
        return self

    def observe_tree(self, nodes: int, ranks: list[int]) -> None:
        """A verified tree of ``nodes`` candidates whose accepted path took the ``ranks``-th
        candidate at each depth (its block is observed as usual too)."""
        self.tree_nodes += nodes
        for r in ranks:
            if len(self.accepted_by_rank) <= r:
                self.accepted_by_rank.extend([0] * (r + 1 - len(self.accepted_by_rank)))
            self.accepted_by_rank[r] += 1

    def conditional_acceptance(self) -> list[float]:
        """[j]: P(position j accepted | positions before j accepted), as measured."""
        return [a / e if e else 0.0 for a, e in zip(self.accepted_by_position, self.examined_by_position)]

    @property
    def mean_accepted_block(self) -> float:
        """Mean accepted tokens per proposed block."""
        return self.accepted / self.blocks if self.blocks else 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        self.blocks += 1
        self.proposed += proposed
        self.accepted += accepted
        examined = min(proposed, accepted + 1)
        for counts, upto in ((self.proposed_by_position, proposed), (self.examined_by_position, examined),
                             (self.accepted_by_position, accepted)):
            if len(counts) < upto:
                counts.extend([0] * (upto - len(counts)))
            for j in range(upto):
                counts[j] += 1


@dataclass(frozen=True)
class BlockOutcome:
    """One block verified during a step: ``proposer`` handed ``proposed`` tokens to
    ``verifier``, which accepted the first ``accepted`` of them. A tree (``candidates`` > 0
    nodes, ``proposed`` deep) tells the branch taken: ``ranks[j]`` is which of its siblings the
    ``j``-th accepted token was (0: the proposer's first choice; the siblings before it were
    tried and refused)."""

    proposer: str
    verifier: str
    proposed: int
    accepted: int
    candidates: int = 0
    ranks: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        if not self.candidates:  # a chain's block: the four numbers
            del d["candidates"], d["ranks"]
        else:
            d["ranks"] = list(self.ranks)
        return d


@dataclass(frozen=True)
class StepProvenance:
    """Where one step's committed tokens came from, recorded only for requests that ask for it
    (``provenance=True``). ``origins[j]`` is the level whose draft ``tokens[j]`` was: a token
    accepted up the path keeps the level that first drafted it; a recovered or bonus token is
    the verifying level's own, so the authority's tokens are those it produced itself.
    ``blocks`` are the step's verifications in the order they ran (the block lengths per edge)."""

    path: tuple[str, ...]
    tokens: tuple[int, ...]
    origins: tuple[str, ...]
    blocks: tuple[BlockOutcome, ...]

    def to_dict(self) -> dict:
        return {"path": list(self.path), "tokens": list(self.tokens), "origins": list(self.origins),
                "blocks": [b.to_dict() for b in self.blocks]}


def cut_provenance(steps: list[StepProvenance], n_tokens: int) -> list[StepProvenance]:
    """The steps behind the first ``n_tokens`` committed tokens (a result cut at a stop string)."""
    out, left = [], n_tokens
    for step in steps:
        if left <= 0:
            break
        if len(step.tokens) > left:
            step = replace(step, tokens=step.tokens[:left], origins=step.origins[:left])
        out.append(step)
        left -= len(step.tokens)
    return out


@dataclass
class RequestStats:
    authority: str
    levels: dict[str, LevelStats] = field(default_factory=dict)
    edges: dict[str, EdgeStats] = field(default_factory=dict)  # key "proposer->verifier"
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. a level that went down

    def level(self, name: str) -> LevelStats:
        return self.levels.setdefault(name, LevelStats())

    def edge(self, proposer: str, verifier: str) -> EdgeStats:
        return self.edges.setdefault(f"{proposer}->{verifier}", EdgeStats())

    @property
    def authority_passes(self) -> int:
        return self.level(self.authority).forward_passes

    @property
    def tokens_per_authority_pass(self) -> float:
        return self.new_tokens / self.authority_passes if self.authority_passes else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def merge(self, other: "RequestStats") -> "RequestStats":
        """Add another request's figures into this one (for totals over many requests)."""
        for name, s in other.levels.items():
            mine = self.level(name)
            mine.forward_passes += s.forward_passes
            mine.seconds += s.seconds
            mine.tokens_proposed += s.tokens_proposed
            mine.early_stops += s.early_stops
        for key, e in other.edges.items():
            self.edges.setdefault(key, EdgeStats()).merge(e)
        self.prompt_tokens += other.prompt_tokens
        self.new_tokens += other.new_tokens
        self.steps += other.steps
        self.wall_seconds += other.wall_seconds
        self.notes.extend(other.notes)
        return self

    def to_dict(self) -> dict:
        d = asdict(self)
        for key, e in self.edges.items():
            d["edges"][key].update(acceptance_rate=e.acceptance_rate, mean_accepted_block=e.mean_accepted_block)
        d.update(
            authority_passes=self.authority_passes,
            tokens_per_authority_pass=self.tokens_per_authority_pass,
            tokens_per_second=self.tokens_per_second,
        )
        return d

    def __str__(self) -> str:
        lines = [
            f"{self.new_tokens} tokens in {self.wall_seconds:.3f} s ({self.tokens_per_second:.1f} tok/s), "
            f"{self.authority_passes} authority passes ({self.tokens_per_authority_pass:.2f} tokens/pass)",
            f"{'level':<14}{'passes':>8}{'seconds':>10}{'proposed':>10}",
        ]
        for name, s in self.levels.items():
            lines.append(f"{name:<14}{s.forward_passes:>8}{s.seconds:>10.3f}{s.tokens_proposed:>10}")
        if self.edges:
            lines.append(f"{'edge':<22}{'blocks':>8}{'proposed':>10}{'accepted':>10}{'rate':>7}{'mean block':>12}")
            for key, e in self.edges.items():
                lines.append(
                    f"{key:<22}{e.blocks:>8}{e.proposed:>10}{e.accepted:>10}"
                    f"{e.acceptance_rate:>7.2f}{e.mean_accepted_block:>12.2f}"
                )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)
