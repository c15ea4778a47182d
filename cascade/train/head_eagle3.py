"""EAGLE-3's two techniques for ``cascade distill --head`` (:mod:`cascade.train.head`), each an option
that leaves a head trained without it as it was.

**Fused features** (``--fuse-layers 2,15,27``, or ``auto``: layers ``2, L // 2, L - 3`` of an
``L``-layer authority, EAGLE-3's choice). The head reads the inputs of a low, a middle and a high
decoder layer of the authority side by side (``fuse_layers`` in its ``head_config.json``),
projected to one hidden state by a learned map (:meth:`workers.head.FeatureHead.project`); the
authority's worker keeps those rows from the passes it runs anyway (:mod:`workers.features`).
The feature cache then holds them beside the last hidden states (which still give the teacher's
distribution); its ``features.json`` and each shard name the layers, and shards computed for
other layers are computed again. As in EAGLE-3 the feature regression is dropped by default
(``--reg-weight`` defaults to 0 with fused features): the fused input is not the space the head
predicts in, and the head is trained on the token loss alone.

**Training-time test** (``--ttt-steps K``, EAGLE-3's and HASS's). A head drafts its second token
from its own predicted feature, not the authority's; trained only on real features, it never
sees that input. So each training window is unrolled ``K`` steps: step 1 as before; at step
``j`` position ``t`` is fed ``(f̂^{j-1}_{t-1}, x_t)`` — the previous step's prediction at the
position before, as the head feeds itself when it drafts — and attends to the real entries up
to ``t - j + 1`` and to its own chain's entries of the earlier steps (one per step, on the
diagonal), exactly what the engine's head attends to at draft position ``j``
(:func:`ttt_mask`). The loss is summed over the steps with weights ``0.8^(j-1)`` (EAGLE-3's),
each step over the positions whose chain starts inside the window and the conversation.
Gradients flow through the fed-back features.

**Continuing a plain head with fused features** (``--init HEAD --fuse-layers ...``, HEAD over the
last hidden state). The head keeps its weights and gains a fuse map fitted by ridge least squares
from the fused inputs to the last hidden states of the training records (:func:`fit_fuse`), so
that it starts close to what HEAD computes. Close, not equal: the last hidden state is the final
norm of the residual stream after every layer, and no linear map of decoder layers' inputs gives
it exactly; the fit's held-out relative error goes into ``training.json`` (``fuse_fit``). Give
``--reg-weight 1`` to keep predicting in that space, as HEAD did.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch
import torch.nn.functional as F

STEP_DECAY = 0.8  # the weight of step j's loss is STEP_DECAY ** (j - 1)


def parse_fuse_layers(text: str | None, num_layers: int) -> list[int] | None:
    """``--fuse-layers``: None/"" (the last hidden state), ``auto`` or comma-separated indices."""
    from workers.features import check_layers

    if not text:
        return None
    if text == "auto":
        layers = sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})
    else:
        try:
            layers = [int(k) for k in text.split(",")]
        except ValueError:
            raise SystemExit(f"cascade distill --head: --fuse-layers {text!r}: comma-separated layer indices "
                             "or auto") from None
    try:
        return check_layers(layers, num_layers)
    except ValueError as exc:
        raise SystemExit(f"cascade distill --head: --fuse-layers: {exc}") from None


@contextmanager
def layer_inputs(authority, layers: Sequence[int] | None):
    """While open, ``taken[0]`` is the last pass's inputs of ``layers`` side by side
    ``[rows, width, len(layers) * hidden]`` (nothing is hooked without layers)."""
    from workers.features import capture_layer_inputs

    taken: list[torch.Tensor | None] = [None]
    handles = capture_layer_inputs(authority, layers, lambda rows: taken.__setitem__(0, rows)) if layers else []
    try:
        yield taken
    finally:
        for handle in handles:
            handle.remove()


class PassCache:
    """The head layer's cache for one pass: the past keys/values, with the pass's appended; keeps
    the pass's new ones."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.keys, self.values, self.new = keys, values, None

    def update(self, keys, values, layer_idx=0, *args, **kwargs):
        self.new = (keys, values)
        if self.keys is None:
            return keys, values
        return torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)


def ttt_mask(mask: torch.Tensor, step: int) -> torch.Tensor:
    """The mask of unrolled step ``step + 1`` (``step`` >= 1) over the keys of steps 1 .. step + 1
    side by side ``[B, 1, T, (step + 1) T]``, from step 1's ``mask`` ``[B, 1, T, T]`` (causal
    within a conversation): position ``t`` sees step 1's entries up to ``t - step`` and, of each
    later step ``i``, the entry at ``t - (step + 1 - i)``: its own chain."""
    width = mask.shape[-1]
    cols = torch.arange(width, device=mask.device)
    rows = cols[:, None]
    blocks = [mask & (cols[None] <= rows - step)]
    for i in range(2, step + 2):
        blocks.append(mask & (cols[None] == rows - (step + 1 - i)))
    return torch.cat(blocks, dim=-1)


def unrolled(head, inputs: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
             steps: int, amp: bool) -> list[torch.Tensor]:
    """The head's predicted features ``[B, T, hidden]`` (float32) at each of ``steps`` unrolled
    steps: step 1 from the source's ``inputs`` (each position's previous feature, projected by
    the head), later steps from the step before's predictions (see the module docstring)."""
    from workers.head import shifted

    preds: list[torch.Tensor] = []
    keys = values = None
    with torch.autocast(embeds.device.type, dtype=torch.bfloat16, enabled=amp):
        feats = head.project(inputs)
        for step in range(steps):
            cache = PassCache(keys, values)
            out = head(feats, embeds, positions, mask if step == 0 else ttt_mask(mask, step), cache)
            new_keys, new_values = cache.new
            keys = new_keys if keys is None else torch.cat([keys, new_keys], dim=2)
            values = new_values if values is None else torch.cat([values, new_values], dim=2)
            preds.append(out.float())
            feats = shifted(out)
    return preds


def step_valid(positions: torch.Tensor, step: int) -> torch.Tensor:
    """``[B, T]`` the positions whose step-``step + 1`` chain starts inside the window and their
    conversation (step 0: all)."""
    inside = torch.arange(positions.shape[1], device=positions.device)[None] >= step
    return (positions >= step) & inside


def _step_terms(objective, head, pred, target, p, entropy, valid):
    """(mean KL, mean regression, top-1 agreement) over ``valid`` positions of one step."""
    weight = valid.float()
    n = weight.sum().clamp(min=1.0)
    student = torch.log_softmax(objective.student_logits(head, pred), -1)
    kl = ((-(p * student).sum(-1) - entropy) * weight).sum() / n
    reg = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * weight).sum() / n
    top1 = ((student.argmax(-1) == p.argmax(-1)).float() * weight).sum() / n
    return kl, reg, top1


def _teacher(objective, target: torch.Tensor):
    with torch.no_grad():
        teacher = torch.log_softmax(target @ objective.rows.T, -1)
        p = teacher.exp()
        return p, -(p * teacher).sum(-1)


def unrolled_losses(objective, head, batch, inputs: torch.Tensor, embeds: torch.Tensor, amp: bool, steps: int):
    """:meth:`cascade.train.head.HeadObjective.losses` unrolled ``steps`` steps: (loss, {reg, kl,
    top1 of step 1, kl_last: the last step's KL}, step 1's predicted features)."""
    target = batch.targets.float()
    p, entropy = _teacher(objective, target)
    preds = unrolled(head, inputs, embeds, batch.positions, batch.mask, steps, amp)
    loss, first, kl = 0.0, None, None
    for step, pred in enumerate(preds):
        kl, reg, top1 = _step_terms(objective, head, pred, target, p, entropy, step_valid(batch.positions, step))
        loss = loss + STEP_DECAY ** step * (objective.reg_weight * reg + objective.cls_weight * kl)
        first = first or {"reg": reg, "kl": kl, "top1": top1}
    return loss, {**first, "kl_last": kl}, preds[0]


@torch.no_grad()
def unrolled_kl(head, objective, sampler, steps: int = 3, max_windows: int = 64) -> list[float]:
    """Held-out KL(authority || head) at each unrolled step (step ``j``: the head drafting its
    ``j``-th token from its own features), teacher-forced tokens; a head trained without the
    training-time test is scored the same way."""
    head.eval()
    sums, counts = [0.0] * steps, [0.0] * steps
    for batch in sampler.all_windows(max_windows):
        batch = batch.to(objective.embed.device)
        target = batch.targets.float()
        p, entropy = _teacher(objective, target)
        preds = unrolled(head, batch.inputs.float(), F.embedding(batch.tokens, objective.embed), batch.positions,
                         batch.mask, steps, amp=False)
        for step, pred in enumerate(preds):
            valid = step_valid(batch.positions, step)
            kl, _, _ = _step_terms(objective, head, pred, target, p, entropy, valid)
            n = float(valid.sum())
            sums[step] += float(kl) * n
            counts[step] += n
    return [s / max(c, 1.0) for s, c in zip(sums, counts)]


def head_options(args, init, num_layers: int) -> list[int] | None:
    """The fused layers a run trains with (``--fuse-layers``, or those of the ``--init`` head it
    continues, which must agree) and ``args.reg_weight`` settled (0 with fused features, EAGLE-3's
    token loss alone; 1 without, unless given)."""
    from workers.head import HeadConfig

    layers = parse_fuse_layers(getattr(args, "fuse_layers", None), num_layers)
    if init is not None:
        had = HeadConfig.load(init).fuse_layers
        if getattr(args, "fuse_layers", None) and had is not None and had != layers:
            raise SystemExit(f"cascade distill --head: --fuse-layers {layers} but the --init head reads {had}")
        layers = layers if had is None else had  # a plain head continued fused: fused_from
    if getattr(args, "ttt_steps", 1) < 1:
        raise SystemExit(f"cascade distill --head: --ttt-steps {args.ttt_steps}: at least 1 (1: no training-time test)")
    if args.reg_weight is None:
        args.reg_weight = 0.0 if layers else 1.0
    return layers


@torch.no_grad()
def fit_fuse(fused: torch.Tensor, features: torch.Tensor, ridge: float = 1e-3, held_every: int = 10,
             chunk: int = 4096) -> tuple[torch.Tensor, dict]:
    """The ``fuse`` weight ``[hidden, feature_width]`` that best maps the fused inputs ``[n,
    feature_width]`` onto the last hidden states ``[n, hidden]`` (ridge least squares in float64,
    ``ridge`` x the mean diagonal of XᵀX), fitted on all rows but every ``held_every``-th; and the
    fit's relative error ``|Y - XW| / |Y|`` and R² on those rows and on the fitted ones."""
    n, width = fused.shape
    held = torch.zeros(n, dtype=torch.bool)
    held[::held_every] = True
    xtx = torch.zeros(width, width, dtype=torch.float64)
    xty = torch.zeros(width, features.shape[1], dtype=torch.float64)
    for i in range(0, n, chunk):  # float64 in chunks: the whole of X would not fit
        x, y, keep = fused[i:i + chunk].double(), features[i:i + chunk].double(), ~held[i:i + chunk]
        xtx += x[keep].T @ x[keep]
        xty += x[keep].T @ y[keep]
    xtx.diagonal().add_(ridge * float(xtx.diagonal().mean()))
    w = torch.linalg.solve(xtx, xty)
    stats = {}
    for name, rows in (("held", held), ("fit", ~held)):
        x, y = fused[rows].double(), features[rows].double()
        err = y - x @ w
        stats[f"rel_err_{name}"] = float(err.norm() / y.norm())
        stats[f"r2_{name}"] = float(1 - err.pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    return w.T.float().contiguous(), stats


def fused_from(head, layers: Sequence[int], data) -> tuple[object, dict]:
    """A head that reads ``layers`` fused, continuing ``head`` (one over the last hidden state):
    its weights, and a fuse map fitted onto the last hidden states of ``data`` (a
    :class:`cascade.train.head.HeadData` with fused inputs of ``layers``): see the module
    docstring. Returns (the head, the fit's figures)."""
    from dataclasses import replace

    from workers.head import FeatureHead

    if head.config.fuse_layers is not None:
        raise ValueError(f"fused_from: the head already fuses layers {head.config.fuse_layers}")
    if data.fused is None or data.fused.shape[1] != head.config.hidden_size * len(layers):
        raise ValueError(f"fused_from: the data hold no fused inputs of {len(layers)} layers")
    fused = FeatureHead(replace(head.config, fuse_layers=[int(k) for k in layers]))
    fused.to(next(head.parameters()).dtype)
    missing, unexpected = fused.load_state_dict(head.state_dict(), strict=False)
    assert missing == ["fuse.weight"] and not unexpected, (missing, unexpected)
    weight, stats = fit_fuse(data.fused, data.features)
    with torch.no_grad():
        fused.fuse.weight.copy_(weight)
    return fused.to(next(head.parameters()).device).train(head.training), stats
