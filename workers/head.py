"""A feature head: a draft level that reads the last hidden states of a transformers level (EAGLE).

The head is one decoder layer over the *features* of the level it reads (its ``features_of``,
usually the authority): the last hidden state at each position, the input of that level's LM
head. At sequence position ``t`` it takes ``(feature_{t-1}, token_t)``:

    x_t  = fc(concat(feature_{t-1}, embed(token_t)))        fc: Linear(2 * hidden, hidden)
    f̂_t  = decoder_layer(x_0 .. x_t)                         one LlamaDecoderLayer, its own RoPE
    logits predicting token_{t+1} = lm_head(f̂_t)

``feature_{-1}`` is a vector of zeros; ``embed`` and ``lm_head`` are the source level's own
modules (a head may carry its own output head, optionally over a trimmed draft vocabulary). Its
folder, fused features (EAGLE-3), how it drafts past the features it was handed, grows trees and
takes features from its source (the hand-off): docs/engine.md, "Feature heads".
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from workers.base import Worker, grow_children, host_logits
from workers.draft_vocab import DraftVocab
from workers.kernels.products import linear_product, own_product, packable
from workers.trees import ancestry

CONFIG = "head_config.json"
WEIGHTS = "model.safetensors"


@dataclass
class HeadConfig:
    """A feature head's shape (``head_config.json``). ``hidden_size`` is the source model's;
    ``vocab_size`` the source's (the authority's) vocabulary; ``lm_head_rows`` > 0: the head has
    its own output head of that many rows (the draft vocabulary's size with ``draft_vocab.json``,
    else ``vocab_size``); 0: it uses the source's LM head."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    head_dim: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    lm_head_rows: int = 0
    fuse_layers: list[int] | None = None

    def __post_init__(self):
        if self.fuse_layers is not None:
            layers = self.fuse_layers
            if (not isinstance(layers, list) or not layers or len(set(layers)) != len(layers)
                    or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in layers)):
                raise ValueError(f"fuse_layers: distinct layer indices >= 0 (or null), not {layers!r}")

    @property
    def feature_width(self) -> int:
        """The width of one feature the head is handed: the source's hidden size, times the
        number of layers it fuses."""
        return self.hidden_size * len(self.fuse_layers or [None])

    @classmethod
    def load(cls, path: str | Path) -> "HeadConfig":
        data = json.loads((Path(path) / CONFIG).read_text())
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{CONFIG}: unknown fields {unknown}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        if data["fuse_layers"] is None:  # a head over the last hidden state writes the file it always did
            del data["fuse_layers"]
        (Path(path) / CONFIG).write_text(json.dumps(data, indent=2) + "\n")

    def llama(self):
        """The transformers LlamaConfig of the head's decoder layer."""
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size, num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_attention_heads, rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size,
            hidden_act=self.hidden_act, attention_bias=self.attention_bias, attn_implementation="sdpa",
        )


class FeatureHead(nn.Module):
    """EAGLE-1's draft head (see the module docstring): ``fc`` over (feature, embedding), one Llama
    decoder layer; logits are an LM head (the source's, or :attr:`lm_head`) applied to the predicted
    features :meth:`forward` returns. :func:`shifted` gives a trainer the inputs of a sequence's
    positions; a head that fuses layers (EAGLE-3) reads its source's features through :meth:`project`."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.config = config
        llama = config.llama()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        # EAGLE-3's fused feature: the chosen layers' hidden states side by side, projected to one
        self.fuse = nn.Linear(config.feature_width, hidden, bias=False) if config.fuse_layers else None
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.lm_head = nn.Linear(hidden, config.lm_head_rows, bias=False) if config.lm_head_rows else None

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The source's features ``[..., feature_width]`` in the space :meth:`forward` reads and
        predicts ``[..., hidden]``: the fused layers projected by :attr:`fuse`, or as they are
        (a head over the last hidden state). A predicted feature ``f̂`` is already in that space."""
        if features.shape[-1] != self.config.feature_width:
            raise ValueError(f"a head reading {self.config.feature_width}-wide features (fuse_layers "
                             f"{self.config.fuse_layers}) was handed {features.shape[-1]}-wide ones")
        return features if self.fuse is None else self.fuse(features)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Predicted features ``[B, T, hidden]`` from ``features`` (each position's previous
        position's feature: zeros at position 0) and ``embeds`` (each position's token), both
        ``[B, T, hidden]``. Without ``attention_mask`` and ``cache``: causal over the ``T``
        positions. ``cache``: an object with ``update(keys, values, layer_idx, ...)`` returning
        the keys/values to attend to (past and new), as transformers' caches do; then
        ``attention_mask`` ``[B, 1, T, past + T]`` (bool) is required."""
        x = self.fc(torch.cat([features, embeds], dim=-1))
        rows, width = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(width, device=x.device)[None].expand(rows, width)
        if attention_mask is None:
            if cache is not None:
                raise ValueError("FeatureHead.forward: a pass over a cache needs its attention_mask")
            attention_mask = torch.ones(width, width, dtype=torch.bool, device=x.device).tril()[None, None]
        return self.layer(x, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                          use_cache=cache is not None, position_embeddings=self.rotary(x, position_ids))

    def save_pretrained(self, path: str | Path, draft_vocab: DraftVocab | None = None) -> None:
        """``head_config.json`` and ``model.safetensors`` (and ``draft_vocab.json``) into ``path``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path / WEIGHTS))
        if draft_vocab is not None:
            draft_vocab.save(path)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device | None = None) -> "FeatureHead":
        from safetensors.torch import load_file

        path = Path(path)
        head = cls(HeadConfig.load(path))
        head.load_state_dict(load_file(str(path / WEIGHTS)), strict=True)
        return head.to(device=device, dtype=dtype).eval()


def shifted(features: torch.Tensor) -> torch.Tensor:
    """Each position's input feature from a sequence's features ``[B, T, hidden]``: position
    ``t`` takes ``features[:, t - 1]``, position 0 zeros (what a trainer feeds the head)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def random_head(authority, seed: int = 0, intermediate_size: int | None = None,
                num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                lm_head_rows: int = 0, scale: float = 1.0, fuse_layers: Sequence[int] | None = None) -> FeatureHead:
    """A randomly initialised head for ``authority`` (a transformers causal LM, or its folder),
    of the authority's width, heads and RoPE base unless told otherwise; ``scale`` multiplies
    its weights (``fc`` and the layer's output projections) to sharpen or flatten its drafts;
    ``fuse_layers``: the authority's layers whose inputs it reads (None: its last hidden state)."""
    if isinstance(authority, (str, Path)):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(authority)
    else:
        config = authority.config
    rope = getattr(config, "rope_parameters", None) or {}
    heads = num_attention_heads or config.num_attention_heads
    head_config = HeadConfig(
        hidden_size=config.hidden_size,
        intermediate_size=intermediate_size or 2 * config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or min(heads, getattr(config, "num_key_value_heads", heads)),
        vocab_size=config.vocab_size,
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
        lm_head_rows=lm_head_rows,
        fuse_layers=None if fuse_layers is None else [int(k) for k in fuse_layers],
    )
    torch.manual_seed(seed)
    head = FeatureHead(head_config)
    if scale != 1.0:
        with torch.no_grad():
            for p in (head.fc.weight, head.layer.self_attn.o_proj.weight, head.layer.mlp.down_proj.weight):
                p.mul_(scale)
    return head.eval()


# -- the worker ------------------------------------------------------------------------------------


@dataclass
class _HeadSeq:
    """One sequence's state in a head: its entries (one per position, in order) and the source's
    features it has been handed but not fed yet."""

    tokens: list[int] = field(default_factory=list)  # the token of each entry
    keys: torch.Tensor | None = None  # [kv_heads, entries, head_dim]
    values: torch.Tensor | None = None
    out: torch.Tensor | None = None  # [entries, hidden]: each entry's predicted feature f̂
    real: int = 0  # the leading entries fed with the source's features (entry 0: the zero feature)
    feats: torch.Tensor | None = None  # the source's features of positions feat_start .. (not fed yet)
    feat_start: int = 0
    feat_tokens: list[int] = field(default_factory=list)  # the tokens those features read

    def crop(self, n: int) -> None:
        if n < len(self.tokens):
            del self.tokens[n:]
            self.keys, self.values, self.out = self.keys[:, :n], self.values[:, :n], self.out[:n]
        self.real = min(self.real, n)


@dataclass
class _TreeGrowth:
    """One sequence's tree while :meth:`HeadWorker.draft_tree` grows it: the nodes fed so far, their
    predicted features and keys/values (entry ``i``: node ``i``, as nodes are fed in node order)."""

    state: _HeadSeq
    tree: tuple[list[int], list[int]]
    widths: list[int]
    frontier: list[int] = field(default_factory=list)
    out: list[torch.Tensor] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


class _PassCache:
    """The head layer's cache for one batched pass: the rows' past keys/values (left-padded),
    with the pass's new ones appended; keeps the new ones for the sequences' own caches."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, keys, values, layer_idx=0, *args, **kwargs):
        self.new = (keys, values)
        return torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)


def _left_pad(x: torch.Tensor | None, length: int, like: torch.Tensor) -> torch.Tensor:
    """``[heads, n, dim]`` (None: n = 0) -> ``[heads, length, dim]``, zeros first."""
    if x is None:
        return like.new_zeros((like.shape[0], length, like.shape[2]))
    return x if x.shape[1] == length else torch.nn.functional.pad(x, (0, 0, length - x.shape[1], 0))


class HeadWorker(Worker):
    """A draft level over a :class:`FeatureHead` and the embedding and LM head of the level whose
    features it reads (see the module docstring). ``features_of`` names that level for the
    engine, which hands the head its features before it drafts (:meth:`hand_off`)."""

    can_score = False

    def __init__(self, head: FeatureHead, embed: nn.Module, lm_head: nn.Module, features_of: str | None = None,
                 draft_vocab: DraftVocab | None = None):
        self.head = head.eval()
        for module in self.head.modules():  # its layer's products: prepacked in bf16, the few-row kernel in float32
            if isinstance(module, nn.Linear) and (product := own_product(module.weight, module.bias)):
                module.forward = product
        self.embed, self.lm_head = embed, lm_head
        self.features_of = features_of
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        config = head.config
        self.hidden_size = config.hidden_size
        rows = int(lm_head.weight.shape[0])
        if config.vocab_size != rows or int(embed.weight.shape[1]) != config.hidden_size:
            raise ValueError(f"the head expects a source of width {config.hidden_size} over {config.vocab_size} "
                             f"tokens; its source has width {int(embed.weight.shape[1])} over {rows}")
        self.vocab_size = rows
        self.draft_vocab = draft_vocab
        if draft_vocab is not None and draft_vocab.authority_vocab_size != rows:
            raise ValueError(f"draft_vocab.json is over {draft_vocab.authority_vocab_size} tokens; the source has {rows}")
        want = (draft_vocab.size - 1) if draft_vocab is not None else rows
        if head.lm_head is not None and head.lm_head.weight.shape[0] != want:
            raise ValueError(f"the head's own lm_head has {head.lm_head.weight.shape[0]} rows; expected {want}")
        # on the host, where the logits come back (Worker.draft)
        self.draft_columns = draft_vocab.columns if draft_vocab is not None else None
        self._order = draft_vocab.order.to(self.device) if draft_vocab is not None else None
        self._trimmed_product = None
        if head.lm_head is None and draft_vocab is not None:  # the source's LM head restricted to the draft vocabulary
            trimmed = lm_head.weight.detach()[self.draft_columns.to(self.device)].clone()
            # multiplied as the lean forward multiplies its source's (workers/lean.py: the
            # few-row kernel, else oneDNN and column-major weights)
            self._trimmed_product = linear_product(trimmed, None, packable(trimmed))
        self.context_length = config.max_position_embeddings
        self._seqs: dict[str, _HeadSeq] = {}

    @classmethod
    def load(cls, path: str | Path, source, features_of: str | None = None) -> "HeadWorker":
        """The head saved in ``path``, over ``source``'s own embedding and LM head (an
        :class:`~workers.hf.HFWorker`, which from now on keeps its features), on its device
        and in its dtype."""
        model = source.model
        head = FeatureHead.from_pretrained(path, dtype=next(model.parameters()).dtype, device=source.device)
        worker = cls(head, model.get_input_embeddings(), model.get_output_embeddings(), features_of,
                     DraftVocab.load(path))
        source.keep_features(head.config.fuse_layers)
        return worker

    def score(self, seq_ids, token_ids, num_positions):
        raise TypeError("a feature head cannot verify; it can only propose")

    # -- the hand-off ------------------------------------------------------------------------

    def features_needed(self, seq_ids: Sequence[str]) -> list[int]:
        """Per sequence, the first position whose source feature the head lacks to feed the
        sequence with real features (it needs those of positions ``start .. len - 2``)."""
        states = [self._seqs.get(s) for s in seq_ids]
        return [0 if state is None else max(min(len(state.tokens), state.real) - 1, 0) for state in states]

    def hand_off(self, source, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                 ends: Sequence[int]) -> list[int]:
        """:meth:`Worker.hand_off` in process: the features of positions :meth:`features_needed`
        .. ``ends[b] - 1`` from ``source`` (an :class:`~workers.hf.HFWorker` keeping them), taken
        with :meth:`take_features`; the indices of the sequences it asked the source for."""
        starts = self.features_needed(seq_ids)
        asked = [b for b in range(len(seq_ids)) if starts[b] < ends[b]]
        if asked:
            feats = source.features([seq_ids[b] for b in asked], [list(token_ids[b])[:ends[b] + 1] for b in asked],
                                    [starts[b] for b in asked])
            self.take_features([seq_ids[b] for b in asked], [token_ids[b] for b in asked],
                               [starts[b] for b in asked], feats)
        return asked

    @torch.inference_mode()
    def take_features(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]], starts: Sequence[int],
                      features: Sequence[torch.Tensor]) -> None:
        """The source's features of positions ``starts[b] .. starts[b] + n_b - 1`` of ``token_ids[b]``
        (``features[b]`` ``[n_b, feature_width]``), for the head's next pass. Entries fed with the
        head's own predictions where these now give the real feature are dropped."""
        width = self.head.config.feature_width
        for s, toks, start, feats in zip(seq_ids, token_ids, starts, features):
            if feats.shape[-1] != width:
                raise ValueError(f"take_features: features of width {feats.shape[-1]}; this head reads "
                                 f"{width} (fuse_layers {self.head.config.fuse_layers})")
            state = self._seqs.setdefault(s, _HeadSeq())
            end = start + feats.shape[0]
            if state.real < len(state.tokens) and end >= state.real:
                state.crop(state.real)  # its first predicted entry now has its real feature
            if start > max(len(state.tokens) - 1, 0):
                raise ValueError(f"take_features: features from position {start}, but the head holds "
                                 f"{len(state.tokens)} entries: positions {max(len(state.tokens) - 1, 0)}.."
                                 f"{start - 1} are missing")
            state.feats = self.head.project(feats.to(device=self.device, dtype=self.dtype))
            state.feat_start, state.feat_tokens = start, list(toks[:end])

    # -- drafting ------------------------------------------------------------------------------

    @torch.inference_mode()
    def _next_logits(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """One drafting step of :meth:`Worker.draft`: logits ``[1, columns]`` predicting the token
        after each sequence (over :attr:`draft_columns` where set)."""
        return list(self._column_logits(self._feed(seq_ids, token_ids))[:, None])

    def _feed(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Each sequence's predicted feature after its last token ``[rows, hidden]``, from the
        head's entries up to that token (fed now where missing: real features first, in one
        pass; then, where the sequence runs past them, one predicted entry per pass)."""
        states = []
        for s, toks in zip(seq_ids, token_ids):
            toks = list(toks)
            if not toks:
                raise ValueError("draft: an empty sequence")
            state = self._seqs.setdefault(s, _HeadSeq())
            if state.feats is not None and toks[:len(state.feat_tokens)] != state.feat_tokens:
                state.feats = None  # handed for another sequence (a rolled-back block)
            states.append((state, toks))
        while True:
            runs = [(b, *self._run(state, toks)) for b, (state, toks) in enumerate(states) if len(state.tokens) < len(toks)]
            if not runs:
                break
            self._pass(runs, states)
        return torch.stack([state.out[-1] for state, _ in states])

    @torch.inference_mode()
    def draft_tree(self, seq_ids: Sequence[str], token_ids: Sequence[Sequence[int]],
                   widths: Sequence[Sequence[int]]) -> list[tuple[list[int], list[int]]]:
        """:meth:`Worker.draft_tree` as EAGLE-2 grows one (docs/engine.md, "Feature heads"): the
        head's entries up to each sequence's last token (as :meth:`draft` feeds them), then one
        batched pass per depth over the new frontier (:meth:`_tree_pass`). The nodes' entries live
        for this call only."""
        trees: list[tuple[list[int], list[int]]] = [([], []) for _ in seq_ids]
        grow = [b for b in range(len(seq_ids)) if widths[b]]
        if not grow:
            return trees
        roots = self._column_logits(self._feed([seq_ids[b] for b in grow], [token_ids[b] for b in grow]))
        grown = [_TreeGrowth(self._seqs[seq_ids[b]], trees[b], list(widths[b])) for b in grow]
        for g, rows in zip(grown, roots[:, None]):
            g.frontier = grow_children(g.tree, [-1], rows, g.widths[0], self.draft_columns)
        for depth in range(1, max(len(g.widths) for g in grown)):
            growing = [g for g in grown if depth < len(g.widths) and g.frontier]
            if not growing:
                break
            rows = self._column_logits(self._tree_pass(growing, depth))
            at = 0
            for g in growing:
                n = len(g.frontier)
                g.frontier = grow_children(g.tree, g.frontier, rows[at:at + n], g.widths[depth], self.draft_columns)
                at += n
        return trees

    def _tree_pass(self, growing: list["_TreeGrowth"], depth: int) -> torch.Tensor:
        """One batched head pass over each growth's frontier nodes, all at ``depth`` (1: the root's
        children) (their entries join the growth's); their predicted features ``[sum of
        frontiers, hidden]``, in order."""
        dev, dtype = self.device, self.dtype
        width = max(len(g.frontier) for g in growing)
        past = max(len(g.state.tokens) for g in growing)
        held = max(len(g.out) for g in growing)
        attn = self.head.layer.self_attn
        kv_heads = self.head.config.num_key_value_heads
        feats = torch.zeros(len(growing), width, self.hidden_size, device=dev, dtype=dtype)
        ids = torch.zeros(len(growing), width, dtype=torch.long, device=dev)
        positions = torch.zeros(len(growing), width, dtype=torch.long, device=dev)
        mask = torch.zeros(len(growing), 1, width, past + held + width, dtype=torch.bool, device=dev)
        mask[:, 0, :, past + held:] = torch.eye(width, dtype=torch.bool, device=dev)  # itself (pads too)
        keys = torch.zeros(len(growing), kv_heads, past + held, attn.head_dim, device=dev, dtype=dtype)
        values = torch.zeros_like(keys)
        for r, g in enumerate(growing):
            c, tokens, parents = len(g.state.tokens), *g.tree
            fed = len(g.out)
            seen = ancestry(parents)[:, :fed]  # a node's ancestors among the nodes fed so far
            keys[r, :, past - c:past] = g.state.keys
            values[r, :, past - c:past] = g.state.values
            if g.out:
                keys[r, :, past:past + len(g.out)] = torch.cat(g.keys, dim=1)
                values[r, :, past:past + len(g.out)] = torch.cat(g.values, dim=1)
            for j, node in enumerate(g.frontier):
                parent = parents[node]
                feats[r, j] = g.state.out[-1] if parent < 0 else g.out[parent]
                ids[r, j] = tokens[node]
                positions[r, j] = c + depth - 1  # the root's children (depth 1) sit at position c
                mask[r, 0, j, past - c:past] = True
                mask[r, 0, j, past:past + fed] = seen[node]
        cache = _PassCache(keys, values)
        out = self.head(feats, self.embed(ids), positions, mask, cache)
        new_keys, new_values = cache.new
        rows = []
        for r, g in enumerate(growing):
            for j, node in enumerate(g.frontier):
                g.out.append(out[r, j])
                g.keys.append(new_keys[r, :, j:j + 1])
                g.values.append(new_values[r, :, j:j + 1])
                rows.append(out[r, j])
        return torch.stack(rows)

    def _run(self, state: _HeadSeq, toks: list[int]) -> tuple[list[int], torch.Tensor, int]:
        """What the next pass can feed a sequence: its next entries' tokens, their input features
        and how many of them are real. The first may use the head's own last prediction; the
        others only features the source handed over."""
        c = len(state.tokens)
        feats, real = [], 0
        for t in range(c, len(toks)):
            f = self._real_feature(state, t)
            if f is None:
                if t > c:
                    break
                f = state.out[t - 1]  # predicted: the head's own f̂ of the entry before
            elif len(feats) == real:
                real += 1
            feats.append(f)
        return toks[c:c + len(feats)], torch.stack(feats), real

    def _real_feature(self, state: _HeadSeq, t: int) -> torch.Tensor | None:
        if t == 0:
            return torch.zeros(self.hidden_size, device=self.device, dtype=self.dtype)
        i = t - 1 - state.feat_start
        if state.feats is not None and 0 <= i < state.feats.shape[0]:
            return state.feats[i]
        return None

    def _pass(self, runs, states) -> None:
        """One batched forward pass of the head: each run's entries after its sequence's cache
        (left-padded pasts, right-padded new entries, a mask hiding the pads)."""
        dev, dtype = self.device, self.dtype
        cached = [states[b][0] for b, *_ in runs]
        lengths = [len(toks) for _, toks, _, _ in runs]
        pasts = [len(state.tokens) for state in cached]
        width, past = max(lengths), max(pasts)
        feats = torch.nn.utils.rnn.pad_sequence([f for _, _, f, _ in runs], batch_first=True)
        ids = torch.tensor([toks + [0] * (width - len(toks)) for _, toks, _, _ in runs], dtype=torch.long, device=dev)
        c = torch.tensor(pasts, device=dev)[:, None]
        positions = c + torch.arange(width, device=dev)
        # a row sees its own past (the last c of the past columns) and, causally, its real new entries;
        # pad rows see the real ones too: no row is empty
        seen_past = torch.arange(past, device=dev) >= past - c
        seen_new = torch.ones(width, width, dtype=torch.bool, device=dev).tril() & (
            torch.arange(width, device=dev) < torch.tensor(lengths, device=dev)[:, None])[:, None, :]
        mask = torch.cat([seen_past[:, None, :].expand(-1, width, -1), seen_new], dim=2)[:, None]
        if past:
            like = next(state.keys for state in cached if state.keys is not None)
            keys = torch.stack([_left_pad(state.keys, past, like) for state in cached])
            values = torch.stack([_left_pad(state.values, past, like) for state in cached])
        else:
            attn = self.head.layer.self_attn
            keys = values = torch.zeros(len(runs), self.head.config.num_key_value_heads, 0, attn.head_dim,
                                        device=dev, dtype=dtype)
        cache = _PassCache(keys, values)
        out = self.head(feats, self.embed(ids), positions, mask, cache)
        new_keys, new_values = cache.new
        for i, (state, (_, toks, _, real)) in enumerate(zip(cached, runs)):
            n, w = len(state.tokens), len(toks)
            k, v, o = new_keys[i, :, :w], new_values[i, :, :w], out[i, :w]
            if n:
                state.keys = torch.cat([state.keys, k], dim=1)
                state.values = torch.cat([state.values, v], dim=1)
                state.out = torch.cat([state.out, o])
            else:
                state.keys, state.values, state.out = k.clone(), v.clone(), o.clone()
            if state.real == n:
                state.real += real
            state.tokens.extend(toks)

    def _column_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (float32 at least, on the host) from predicted features
        ``[rows, hidden]``; over :attr:`draft_columns` alone where there is a draft vocabulary."""
        if self.head.lm_head is not None:
            logits = self.head.lm_head(hidden)
            if self._order is not None:
                logits = logits[:, self._order]
        elif self._trimmed_product is not None:
            logits = self._trimmed_product(hidden)
        else:
            logits = self.lm_head(hidden)
        return host_logits(logits)

    # -- bookkeeping ---------------------------------------------------------------------------

    def hold(self, seq_ids: Sequence[str], held: Sequence[int]) -> None:
        for s, n in zip(seq_ids, held):
            if s in self._seqs:
                self._seqs[s].crop(n)

    def release(self, seq_ids: Sequence[str]) -> None:
        for s in seq_ids:
            self._seqs.pop(s, None)

    def cached_sequences(self) -> int:
        return len(self._seqs)

    def close(self) -> None:
        self._seqs.clear()

