"""``cascade distill --head``: train a feature head (EAGLE-1, :mod:`workers.head`) for an authority
on what ``cascade record`` recorded: the authority's own conversations.

::

    cascade distill --head --records runs/rec --draft-vocab 8192 --out runs/head

**Features.** The head learns to predict the authority's *features* (its last hidden state at a
position, after the final norm: the input of its LM head) from the feature before and the token
at that position. The recorded shards hold tokens, not features, so a teacher-forced pass of the
frozen authority over every recorded conversation computes them once and caches them beside the
records (``RECORDS/features/shard-NNNNN.pt``, one per record shard, bfloat16, written atomically;
``features.json`` names the authority and its dtype). A killed run redoes at most the shard it
was computing; epochs then cost only the head.

**Loss** (EAGLE-1): ``reg_weight * SmoothL1(f̂_t, f_t)`` (mean over the width, then over positions)
``+ cls_weight * KL(p_t || q_t)``, where ``p_t`` is the authority's distribution at ``t`` (its LM
head on ``f_t``) and ``q_t`` the head's (the authority's LM head on ``f̂_t``, or the head's own
output head with ``--head-lm-head own``), both over the draft vocabulary when ``--draft-vocab N``
trims it (chosen from the records as the drafters' is: :func:`cascade.train.records.choose_draft_vocab`).
``--feature-noise A`` adds uniform noise of ``A`` times the features' RMS to the head's input
features during training (EAGLE's augmentation against its own feature errors when drafting).
The authority's embedding and LM head are frozen and never saved with the head. Windows of the
packed conversations never attend across a conversation's start, and positions count from it.

**Held out** (the records' held-out shards, :func:`cascade.train.records.record_shards`):
teacher-forced loss, the head's top-1 agreement with the authority's argmax over its whole
vocabulary, the expected acceptance of one drafted token at T = 1, and the greedy acceptance at
draft positions 1..3 measured by drafting: at sampled positions of held-out conversations the
head drafts three tokens from its own predicted features, as it does in the engine, and one
authority pass (a 4D mask over the conversation and every chain) says which it would accept.
EAGLE-3's fused features (``--fuse-layers``) and training-time test (``--ttt-steps``): see
:mod:`cascade.train.head_eagle3`. They go into ``training.json`` beside the head, which :meth:`workers.head.FeatureHead.save_pretrained`
writes so that a topology level ``kind: head, model: OUT, features_of: <authority>`` loads it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cascade.train.head_eagle3 import PassCache

FEATURES = "features"  # the feature cache's folder inside the records folder (default)
META = "features.json"


# --------------------------------------------------------------------------- the feature cache


def base_model(authority):
    """The authority's body: its last hidden states are the features (after the final norm)."""
    return authority.base_model


@torch.inference_mode()
def conversation_features(authority, tokens: torch.Tensor, lengths: list[int], chunk_tokens: int = 4096,
                          layers: list[int] | None = None):
    """The authority's features at every position of the packed conversations ``tokens``
    (``lengths`` each, each from position 0), ``[n, hidden]`` bfloat16. Conversations go through
    in right-padded groups of similar length, at most ``chunk_tokens`` padded tokens a pass.
    With ``layers`` (a fused head's, :mod:`cascade.train.head_eagle3`): the pair of those and the
    inputs of those decoder layers side by side ``[n, len(layers) * hidden]``, from the same passes."""
    from cascade.train.head_eagle3 import layer_inputs

    with layer_inputs(authority, layers) as taken:
        return _conversation_features(authority, tokens, lengths, chunk_tokens, layers, taken)


def _conversation_features(authority, tokens, lengths, chunk_tokens, layers, taken):
    body = base_model(authority)
    device = next(authority.parameters()).device
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    out = torch.empty(offsets[-1], authority.config.hidden_size, dtype=torch.bfloat16)
    fused = torch.empty(offsets[-1], len(layers) * out.shape[1], dtype=torch.bfloat16) if layers else None
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    group: list[int] = []
    for i in order + [None]:
        if i is not None and (not group or (len(group) + 1) * lengths[group[0]] <= chunk_tokens):
            group.append(i)
            continue
        width = lengths[group[0]]
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, c in enumerate(group):
            ids[r, :lengths[c]] = tokens[offsets[c]:offsets[c + 1]]
            mask[r, :lengths[c]] = 1
        hidden = body(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for r, c in enumerate(group):
            out[offsets[c]:offsets[c + 1]] = hidden[r, :lengths[c]].to("cpu", torch.bfloat16)
            if fused is not None:
                fused[offsets[c]:offsets[c + 1]] = taken[0][r, :lengths[c]].to("cpu", torch.bfloat16)
        group = [] if i is None else [i]
    return out if fused is None else (out, fused)


def cache_features(records: Path, out: Path, authority, ref: str, log=print, chunk_tokens: int = 4096,
                   layers: list[int] | None = None, shards: list[Path] | None = None) -> dict:
    """Compute the features of every record shard (of ``shards`` alone, if given) not yet in
    ``out`` (resumable to the shard); returns ``features.json``'s content. ``layers``: also the
    inputs of those decoder layers (a fused head's); a shard kept for other layers is computed again."""
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / META
    dtype = str(next(authority.parameters()).dtype).replace("torch.", "")
    hidden = authority.config.hidden_size
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {
        "model": ref, "dtype": dtype, "hidden_size": hidden, "storage": "bfloat16", "shards": {}}
    if (meta["model"], meta["dtype"], meta["hidden_size"]) != (ref, dtype, hidden):
        raise SystemExit(f"cascade distill --head: {out} holds features of {meta['model']} in {meta['dtype']} "
                         f"(width {meta['hidden_size']}), not of {ref} in {dtype}: remove it or give --features DIR")
    shards = sorted(records.glob("shard-*.pt")) if shards is None else list(shards)
    todo = [s for s in shards if not (out / s.name).is_file()
            or meta["shards"].get(s.name, {}).get("layers") != layers]
    meta["layers"] = layers
    if todo:
        log(f"features: {len(todo)} of {len(shards)} record shards to compute into {out} ({ref}, {dtype}"
            f"{f', layers {layers}' if layers else ''})")
    redo = {s.name for s in todo if (out / s.name).is_file()}  # kept for other layers
    for path in todo:
        if path.name not in redo and (out / path.name).is_file():
            continue  # another process computing into the same folder did this one meanwhile
        started = time.perf_counter()
        shard = torch.load(path, weights_only=False)
        tokens, lengths = shard["tokens"].long(), shard["lengths"].tolist()
        feats = conversation_features(authority, tokens, lengths, chunk_tokens, layers)
        kept = {"features": feats} if not layers else {"features": feats[0], "fused": feats[1], "layers": layers}
        tmp = (out / path.name).with_suffix(".tmp")
        torch.save({**kept, "tokens": shard["tokens"], "lengths": shard["lengths"]}, tmp)
        tmp.rename(out / path.name)
        took = time.perf_counter() - started
        if meta_path.is_file():  # what another process computing into this folder wrote meanwhile
            meta["shards"] = {**json.loads(meta_path.read_text())["shards"], **meta["shards"]}
        meta["shards"][path.name] = {"tokens": len(tokens), "seconds": round(took, 1),
                                     **({"layers": layers} if layers else {})}
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        log(f"features: {path.name}: {len(tokens):,} tokens in {took:.0f} s ({len(tokens) / took:.0f} tokens/s); "
            f"{len(meta['shards'])}/{len(shards)} shards")
    return meta


@dataclass
class HeadData:
    """Conversations packed into one stream with their features: ``features[i]`` is the authority's
    feature after reading ``tokens[i]`` (its position ``position[i]`` in conversation ``conv[i]``)."""

    tokens: torch.Tensor  # [n] int64
    features: torch.Tensor  # [n, hidden] bfloat16
    position: torch.Tensor  # [n] int64
    conv: torch.Tensor  # [n] int64
    lengths: list[int]
    fused: torch.Tensor | None = None  # [n, layers x hidden] bfloat16: a fused head's inputs (else None)

    @property
    def inputs(self) -> torch.Tensor:
        """What the head reads of each position (before :meth:`workers.head.FeatureHead.project`)."""
        return self.features if self.fused is None else self.fused

    def conversations(self):
        """``(start, length)`` of each conversation in the stream."""
        start = 0
        for n in self.lengths:
            yield start, n
            start += n

    def rms(self) -> float:
        """The input features' root mean square (over a sample of positions)."""
        step = max(1, self.inputs.shape[0] // 4096)
        return float(self.inputs[::step].float().pow(2).mean().sqrt())


def load_head_data(records: Path, features: Path, held_out: bool, held_out_every: int = 20,
                   layers: list[int] | None = None) -> HeadData:
    """The training (or held-out) record shards with their cached features (every
    ``held_out_every``-th shard is held out: 1 for a folder of held-out shards alone);
    ``layers``: with the fused features of those layers."""
    from cascade.train.records import record_shards

    tokens, feats, lengths, fused = [], [], [], []
    for path in record_shards(records, held_out, held_out_every):
        cached = features / path.name
        if not cached.is_file():
            raise SystemExit(f"cascade distill --head: no cached features for {path.name} in {features}")
        shard = torch.load(cached, weights_only=False)
        if not torch.equal(shard["tokens"], torch.load(path, weights_only=False)["tokens"]):
            raise SystemExit(f"cascade distill --head: {cached} was computed for other tokens than {path}: remove it")
        if layers and shard.get("layers") != layers:
            raise SystemExit(f"cascade distill --head: {cached} holds the features of layers {shard.get('layers')}, "
                             f"not {layers}: compute them again (cache_features)")
        tokens.append(shard["tokens"].long())
        feats.append(shard["features"])
        if layers:
            fused.append(shard["fused"])
        lengths += shard["lengths"].tolist()
    conv = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    position = torch.arange(conv.numel()) - starts[conv]
    return HeadData(torch.cat(tokens), torch.cat(feats), position, conv, lengths,
                    torch.cat(fused) if layers else None)


# --------------------------------------------------------------------------- batches


@dataclass
class HeadBatch:
    """Windows of the stream: tokens, each position's input feature (the one before it in its
    conversation, zeros at a conversation's start), its target feature, positions counted from
    the conversation's start and a mask that keeps attention inside a conversation."""

    tokens: torch.Tensor  # [batch, seq_len]
    inputs: torch.Tensor  # [batch, seq_len, feature width] bfloat16 (a fused head's: layers x hidden)
    targets: torch.Tensor  # [batch, seq_len, hidden] bfloat16
    positions: torch.Tensor  # [batch, seq_len]
    mask: torch.Tensor  # [batch, 1, seq_len, seq_len] bool

    def to(self, device) -> "HeadBatch":
        return HeadBatch(*(t.to(device) for t in (self.tokens, self.inputs, self.targets, self.positions, self.mask)))

    def input_tokens(self) -> int:
        return self.tokens.numel()


class HeadSampler:
    """``batch(step)``: a pure function of the seed and the step, like the other samplers."""

    def __init__(self, data: HeadData, seq_len: int, batch_size: int, seed: int = 0):
        if data.tokens.numel() < seq_len:
            raise SystemExit(f"cascade distill --head: the records hold {data.tokens.numel()} tokens, "
                             f"fewer than --seq-len {seq_len}")
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed

    def batch(self, step: int) -> HeadBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.tokens.numel() - self.seq_len + 1, (self.batch_size,), generator=g)
        return self._windows(starts)

    def _windows(self, starts: torch.Tensor) -> HeadBatch:
        d = self.data
        idx = starts[:, None] + torch.arange(self.seq_len)
        pos = d.position[idx]
        inputs = torch.where((pos > 0)[..., None], d.inputs[(idx - 1).clamp(min=0)], 0)
        conv = d.conv[idx]
        causal = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool).tril()
        mask = (conv[:, :, None] == conv[:, None, :]) & causal
        return HeadBatch(d.tokens[idx], inputs, d.features[idx], pos, mask[:, None])

    def all_windows(self, max_windows: int = 64, per_batch: int = 8):
        """Consecutive windows from the start (held-out evaluation)."""
        n = min(max_windows, self.data.tokens.numel() // self.seq_len)
        starts = torch.arange(n) * self.seq_len
        for i in range(0, n, per_batch):
            yield self._windows(starts[i:i + per_batch])


# --------------------------------------------------------------------------- the loss


class HeadObjective:
    """The frozen parts of the authority a head trains against (its embedding, its LM head over
    the draft vocabulary), the loss, and one training step (``train_students``' ``step_fn``)."""

    def __init__(self, embed: torch.Tensor, lm_head: torch.Tensor, ids: torch.Tensor | None, device,
                 reg_weight: float = 1.0, cls_weight: float = 0.1, noise: float = 0.0, feature_rms: float = 1.0,
                 ttt_steps: int = 1):
        self.embed = embed.detach().to(device, torch.float32)
        same = lm_head.data_ptr() == embed.data_ptr()  # tied: one copy
        self.full = self.embed if same else lm_head.detach().to(device, torch.float32)
        self.ids = None if ids is None else ids.to(device)
        self.rows = self.full if ids is None else self.full[self.ids]
        self.reg_weight, self.cls_weight = reg_weight, cls_weight
        self.noise, self.feature_rms = noise, feature_rms
        self.ttt_steps = ttt_steps  # > 1: the training-time test (cascade.train.head_eagle3)

    def student_logits(self, head, pred: torch.Tensor) -> torch.Tensor:
        """The head's logits over the draft vocabulary (or the whole) from predicted features."""
        if head.lm_head is not None:
            return head.lm_head(pred).float()
        return pred.float() @ self.rows.T

    def to_authority(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.ids is None else self.ids[draft_ids]

    def losses(self, head, batch: HeadBatch, amp: bool, train: bool):
        """(loss, {reg, kl, top1}, predicted features) of ``head`` on ``batch``; ``top1``: the head's
        argmax equals the authority's over the draft vocabulary."""
        device = batch.tokens.device
        inputs = batch.inputs.float()
        if train and self.noise > 0:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * (self.noise * self.feature_rms)
        embeds = F.embedding(batch.tokens, self.embed)
        if self.ttt_steps > 1:
            from cascade.train.head_eagle3 import unrolled_losses

            return unrolled_losses(self, head, batch, inputs, embeds, amp, self.ttt_steps)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            pred = head(head.project(inputs), embeds, batch.positions, batch.mask)
        pred = pred.float()
        target = batch.targets.float()
        reg = F.smooth_l1_loss(pred, target, reduction="none").mean(-1).mean()
        with torch.no_grad():
            teacher = torch.log_softmax(target @ self.rows.T, -1)
            p = teacher.exp()
            entropy = -(p * teacher).sum(-1).mean()
        student = torch.log_softmax(self.student_logits(head, pred), -1)
        kl = -(p * student).sum(-1).mean() - entropy
        top1 = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
        loss = self.reg_weight * reg + self.cls_weight * kl
        return loss, {"reg": reg, "kl": kl, "top1": top1}, pred

    def __call__(self, students: dict, optims: dict, batch: HeadBatch, lr: float, opt, running: dict,
                 device) -> dict[str, str]:
        from cascade.train.trainer import _optimizer_step

        head = students["head"]
        loss, parts, _ = self.losses(head, batch, opt.amp, train=True)
        _optimizer_step(head, optims["head"], loss, lr, opt)
        val = loss.item()
        running["head"] = val if running["head"] is None else 0.95 * running["head"] + 0.05 * val
        last = f" kl@{self.ttt_steps} {parts['kl_last'].item():.3f}" if "kl_last" in parts else ""
        return {"head": f"{running['head']:.3f} (reg {parts['reg'].item():.3f} kl {parts['kl'].item():.3f}{last} "
                        f"top1 {parts['top1'].item():.2f})"}


# --------------------------------------------------------------------------- held-out evaluation


@torch.no_grad()
def evaluate_head(head, objective: HeadObjective, sampler: HeadSampler, max_windows: int = 64) -> dict:
    """Teacher-forced held-out figures (means over positions): the loss and its parts, the head's
    top-1 agreement with the authority's argmax over its whole vocabulary (a token outside the
    draft vocabulary is a miss), and the expected acceptance of one drafted token at T = 1,
    ``sum(min(p, q))`` with ``p`` the authority's whole distribution."""
    head.eval()
    sums = {"loss": 0.0, "reg": 0.0, "kl": 0.0, "top1_agreement": 0.0, "expected_acceptance_t1": 0.0}
    n = 0
    for batch in sampler.all_windows(max_windows):
        batch = batch.to(objective.embed.device)
        loss, parts, pred = objective.losses(head, batch, amp=False, train=False)
        rows = batch.tokens.numel()
        q = torch.softmax(objective.student_logits(head, pred), -1).flatten(0, 1)
        drafted = objective.to_authority(q.argmax(-1))
        agree = accept = 0.0
        target = batch.targets.float().flatten(0, 1)
        for part in range(0, rows, 512):  # the whole vocabulary's logits, a slice at a time
            p = torch.softmax(target[part:part + 512] @ objective.full.T, -1)
            agree += float((p.argmax(-1) == drafted[part:part + 512]).sum())
            p_draft = p if objective.ids is None else p[:, objective.ids]
            accept += float(torch.minimum(p_draft, q[part:part + 512]).sum())
        for key, val in (("loss", loss.item()), ("reg", parts["reg"].item()), ("kl", parts["kl"].item())):
            sums[key] += val * rows
        sums["top1_agreement"] += agree
        sums["expected_acceptance_t1"] += accept
        n += rows
    return {**{k: v / max(1, n) for k, v in sums.items()}, "positions": n}


def _model_mask(model, mask: torch.Tensor) -> torch.Tensor:
    """A 4D boolean mask in the form the model's attention takes (additive for eager)."""
    if getattr(model.config, "_attn_implementation", None) == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask


def answer_starts(data: HeadData, marker: list[int]) -> list[int | None]:
    """Per conversation, where its answer begins: just after the last occurrence of ``marker``
    (the chat template's generation prompt, e.g. ``<|im_start|>assistant\n``), or None."""
    out: list[int | None] = []
    n = len(marker)
    for start, length in data.conversations():
        toks = data.tokens[start:start + length].tolist()
        out.append(next((i + n for i in range(length - n, -1, -1) if toks[i:i + n] == marker), None))
    return out


def generation_prompt(tokenizer) -> list[int] | None:
    """The token ids a chat template appends to open the assistant's turn, or None without one."""
    try:
        turn = [{"role": "user", "content": "x"}]
        bare = tokenizer.apply_chat_template(turn, tokenize=True)
        opened = tokenizer.apply_chat_template(turn, tokenize=True, add_generation_prompt=True)
    except (AttributeError, ValueError):  # not a chat tokenizer / no chat template
        return None
    bare, opened = (list(x["input_ids"] if hasattr(x, "keys") else x) for x in (bare, opened))
    return opened[len(bare):] if len(opened) > len(bare) and opened[:len(bare)] == bare else None


@torch.no_grad()
def draft_acceptance(head, objective: HeadObjective, authority, data: HeadData, starts: int = 256,
                     depth: int = 3, per_conversation: int = 16, seed: int = 0,
                     answers: list[int | None] | None = None, temperature: float = 0.0) -> dict:
    """Acceptance by draft position, measured by drafting: at up to ``starts`` positions
    ``p`` of held-out conversations (up to ``per_conversation`` each), the head drafts ``depth``
    tokens after ``x_0..x_p`` as it does in the engine (real features up to ``p - 1``, then its
    own predicted ones), and the authority's greedy tokens after the same prefixes, with each
    drafted token appended, are computed in one pass per conversation (a 4D mask over the
    conversation and every chain). ``accepted_at[k-1]``: share of starts whose first ``k``
    drafts are all the authority's greedy tokens.

    With ``temperature > 0`` the head samples its chains (softmax at that temperature over its
    vocabulary, no top-k/top-p) and a drafted token ``x`` is accepted with probability
    ``min(1, target(x) / draft(x))``, both at that temperature, as the engine's rule does:
    ``accepted_at[k-1]`` is the mean over starts of the product of those probabilities up to
    ``k`` (an unbiased estimate of the chance that the first ``k`` are accepted).

    ``answers`` (:func:`answer_starts`) restricts the starts to drafting the answers, as the
    engine does: the system prompt and the user's turn are far easier to draft than an answer,
    so figures over every position flatter the head."""
    head.eval()
    device = objective.embed.device
    body = base_model(authority)
    g = torch.Generator().manual_seed(seed)
    spans = [(start, length, 0 if answers is None else answers[i])
             for i, (start, length) in enumerate(data.conversations())]
    # p drafts x_{p+1}: from the last token before the answer to the one before the last
    conversations = [(start, length, max(first - 1, 0)) for start, length, first in spans
                     if first is not None and length - 1 > max(first - 1, 0)]
    order = torch.randperm(len(conversations), generator=g).tolist()
    accepted: list[torch.Tensor] = []
    taken = 0
    for ci in order:
        if taken >= starts:
            break
        start, length, lo = conversations[ci]
        k = min(per_conversation, length - 1 - lo, starts - taken)
        chosen = (lo + torch.randperm(length - 1 - lo, generator=g)[:k]).sort().values.to(device)
        tokens = data.tokens[start:start + length].to(device)
        feats = data.inputs[start:start + length].to(device, torch.float32)
        drafts, drafted = _head_chains(head, objective, tokens, feats, chosen, depth, temperature, g)
        logits = _authority_logits(body, objective, tokens, chosen, drafts, authority)  # [k, depth, vocab]
        if temperature > 0:
            target = torch.softmax(logits / temperature, -1).gather(-1, drafts[..., None])[..., 0]
            accept = (target / drafted).clamp(max=1.0)
        else:
            accept = (drafts == logits.argmax(-1)).float()
        accepted.append(accept.cumprod(-1))  # [k, depth]: all drafts up to here accepted
        taken += k
    if not accepted:
        return {"starts": 0}
    acc = torch.cat(accepted).float()
    at = acc.mean(0).tolist()
    return {"starts": acc.shape[0], "depth": depth, "positions": "all" if answers is None else "answers",
            "temperature": temperature,
            "accepted_at": at,
            "conditional": [at[0]] + [at[i] / at[i - 1] if at[i - 1] > 0 else 0.0 for i in range(1, depth)],
            "mean_accepted": float(acc.sum(-1).mean()),
            "tokens_per_authority_pass": 1.0 + float(acc.sum(-1).mean())}


def _head_chains(head, objective: HeadObjective, tokens, feats, chosen, depth: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's drafts ``[k, depth]`` (authority ids) after each chosen position, greedy or
    sampled at ``temperature``, and the probability each was drafted with ``[k, depth]`` (1 greedy)."""
    from workers.head import shifted

    length, k = tokens.numel(), chosen.numel()
    dev = tokens.device
    dtype = next(head.parameters()).dtype
    causal = torch.ones(length, length, dtype=torch.bool, device=dev).tril()[None, None]
    cache = PassCache()
    out = head(shifted(head.project(feats[None].to(dtype))), F.embedding(tokens, objective.embed)[None].to(dtype),
               torch.arange(length, device=dev)[None], causal, cache)[0]
    keys, values = cache.new
    pred = out[chosen]

    def pick(pred):
        logits = objective.student_logits(head, pred).float()
        if temperature <= 0:
            return objective.to_authority(logits.argmax(-1)), torch.ones(logits.shape[0], device=dev)
        probs = torch.softmax(logits / temperature, -1)
        chosen_ids = torch.multinomial(probs.cpu(), 1, generator=generator).to(dev)
        return objective.to_authority(chosen_ids[:, 0]), probs.gather(-1, chosen_ids)[:, 0]

    token, prob = pick(pred)
    drafts, drafted = [token], [prob]
    columns = torch.arange(length, device=dev)
    for d in range(1, depth):
        # each chain's entry: its previous predicted feature and draft, at p + d; it sees the
        # conversation up to p and its own chain
        trunk = (columns[None] <= chosen[:, None])
        chain = torch.eye(k, dtype=torch.bool, device=dev).repeat(1, d)
        mask = torch.cat([trunk, chain], dim=1)[None, None]
        cache = PassCache(keys, values)
        pred = head(pred[None], F.embedding(drafts[-1], objective.embed)[None].to(dtype),
                    (chosen + d)[None], mask, cache)[0]
        keys = torch.cat([keys, cache.new[0]], dim=2)
        values = torch.cat([values, cache.new[1]], dim=2)
        token, prob = pick(pred)
        drafts.append(token)
        drafted.append(prob)
    return torch.stack(drafts, dim=1), torch.stack(drafted, dim=1)


def _authority_logits(body, objective: HeadObjective, tokens, chosen, drafts, authority) -> torch.Tensor:
    """The authority's logits ``[k, depth, vocab]`` after each chain's prefix: the conversation up
    to ``p``, then the chain's first ``j`` drafts (``j`` = 0 .. depth - 1), in one pass."""
    length, k, depth = tokens.numel(), chosen.numel(), drafts.shape[1]
    dev = tokens.device
    nodes = drafts[:, :depth - 1].T.reshape(-1)  # depth-major: node (j, i) drafted token j+1 of chain i
    ids = torch.cat([tokens, nodes])
    positions = torch.cat([torch.arange(length, device=dev),
                           (chosen[None] + torch.arange(1, depth, device=dev)[:, None]).reshape(-1)])
    total = ids.numel()
    mask = torch.zeros(total, total, dtype=torch.bool, device=dev)
    mask[:length, :length] = torch.ones(length, length, dtype=torch.bool, device=dev).tril()
    columns = torch.arange(length, device=dev)
    for j in range(depth - 1):
        rows = slice(length + j * k, length + (j + 1) * k)
        mask[rows, :length] = columns[None] <= chosen[:, None]
        for jj in range(j + 1):
            mask[rows, length + jj * k:length + (jj + 1) * k] = torch.eye(k, dtype=torch.bool, device=dev)
    hidden = body(input_ids=ids[None], attention_mask=_model_mask(authority, mask[None, None]),
                  position_ids=positions[None]).last_hidden_state[0]
    rows = torch.cat([chosen, length + torch.arange((depth - 1) * k, device=dev)])
    logits = hidden[rows].float() @ objective.full.T
    return logits.reshape(depth, k, -1).transpose(0, 1)


# --------------------------------------------------------------------------- the command


def run_head(args) -> int:
    """``cascade distill --head``: features cached, the head trained (resumable), evaluated and saved."""
    from transformers import AutoModelForCausalLM

    from cascade.pull import PULLED, resolve_pulled
    from cascade.train.corpus import load_tokenizer
    from cascade.train.session import optimisation, session, setup_torch
    from cascade.train.records import choose_draft_vocab, load_records
    from cascade.train.trainer import log, train_students
    from workers.devices import resolve_dtype
    from workers.draft_vocab import DraftVocab
    from cascade.train.head_eagle3 import fused_from, head_options, unrolled_kl
    from workers.head import FeatureHead, random_head

    device = setup_torch(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    records = Path(args.records)
    meta_path = records / "record.json"
    if not meta_path.is_file():
        raise SystemExit(f"cascade distill: {records} has no record.json (write it with cascade record)")
    ref = args.teacher or json.loads(meta_path.read_text())["model"]
    path = str(resolve_pulled(ref)) if ref.startswith(PULLED) else ref
    dtype = resolve_dtype(args.teacher_dtype, device)
    authority = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    for p in authority.parameters():
        p.requires_grad_(False)
    features = Path(args.features) if args.features else records / FEATURES
    say = lambda msg: log(msg, work_dir)  # noqa: E731
    init = Path(args.init[0]) if args.init else None
    layers = head_options(args, init, authority.config.num_hidden_layers)  # EAGLE-3's options
    cache_features(records, features, authority, ref, say, layers=layers)
    train = load_head_data(records, features, held_out=False, layers=layers)
    held = load_head_data(records, features, held_out=True, layers=layers)
    config = authority.config
    vocab, covered = None, 1.0
    tokenizer = load_tokenizer(path)
    if init is not None:  # continue a head: its draft vocabulary goes with its weights
        vocab = DraftVocab.load(init)
        covered = json.loads((init / "draft_vocab.json").read_text()).get("coverage", 1.0) if vocab else 1.0
    elif args.draft_vocab:
        ids, covered = choose_draft_vocab(load_records(records, held_out=False), args.draft_vocab, config.vocab_size,
                                          tokenizer.all_special_ids)
        vocab = DraftVocab(ids, config.vocab_size)
    rms = train.rms()
    objective = HeadObjective(authority.get_input_embeddings().weight, authority.get_output_embeddings().weight,
                              None if vocab is None else vocab.ids, device, args.reg_weight, args.cls_weight,
                              args.feature_noise, rms, args.ttt_steps)
    rows = 0 if args.head_lm_head == "authority" else (len(vocab.ids) if vocab is not None else config.vocab_size)
    if init is not None:
        head = FeatureHead.from_pretrained(init, dtype=torch.float32, device=device).train(False)
        rows = head.config.lm_head_rows
        if layers and head.config.fuse_layers is None:  # a plain head continued with fused features
            head, args.fuse_fit = fused_from(head, layers, train)
            say(f"head: {init} continued over layers {layers}: fuse map fitted onto its last hidden states, "
                f"{_rounded(args.fuse_fit)}")
    else:
        head = random_head(authority, seed=args.seed + 1, intermediate_size=args.head_ffn or config.intermediate_size,
                           lm_head_rows=rows, fuse_layers=layers).float()
    if rows and init is None:
        with torch.no_grad():  # its own output head starts as the authority's rows
            head.lm_head.weight.copy_(objective.rows.cpu())
    params = sum(p.numel() for p in head.parameters())
    say(f"head: {params:,} parameters (ffn {head.config.intermediate_size}, output head "
        f"{'own, ' + str(rows) + ' rows' if rows else 'the authority'}'s); records: {train.tokens.numel():,} "
        f"training tokens, {held.tokens.numel():,} held out; draft vocabulary "
        f"{len(vocab.ids) if vocab else config.vocab_size} tokens covering {covered:.4f} of the recorded mass; "
        f"feature RMS {rms:.3f}")
    sampler = HeadSampler(train, args.seq_len, args.batch_size, seed=args.seed)
    lr = args.lr if args.lr is not None else 1e-3
    opt = optimisation(args, device, lr, warmup=min(args.warmup, max(1, args.steps // 10)))
    summary = train_students({"head": head}, None, sampler, args.steps, opt,
                             session(args, work_dir / "checkpoint.pt", args.max_minutes, "head"), device,
                             step_fn=objective)
    if summary["interrupted"]:
        return 0
    held_sampler = HeadSampler(held, args.seq_len, args.batch_size)
    metrics = evaluate_head(head, objective, held_sampler)
    metrics["kl_by_draft_step"] = unrolled_kl(head, objective, held_sampler)
    say(f"head: held-out {_rounded(metrics)}")
    drafting = {"starts": 0}
    if args.eval_drafts > 0:
        started = time.perf_counter()
        marker = generation_prompt(tokenizer)
        answers = answer_starts(held, marker) if marker else None
        drafting = draft_acceptance(head, objective, authority, held, starts=args.eval_drafts, seed=args.seed,
                                    answers=answers)
        drafting["seconds"] = round(time.perf_counter() - started, 1)
        say(f"head: greedy drafting in held-out {drafting.get('positions', '')} {_rounded(drafting)}")
    _save_head(args, head, vocab, covered, summary, metrics, drafting, ref, features, train, held, rms, lr, params,
               device, say)
    return 0


def _rounded(d: dict) -> dict:
    r = lambda v: round(v, 4) if isinstance(v, float) else ([r(x) for x in v] if isinstance(v, list) else v)  # noqa: E731
    return {k: r(v) for k, v in d.items()}


def _save_head(args, head, vocab, covered, summary, metrics, drafting, ref, features, train, held, rms, lr, params,
               device, say) -> None:
    from cascade.train.session import run_record
    from workers.base import DTYPES

    out = Path(args.out[0]) if args.out else Path(args.work_dir) / "head"
    steps = summary["steps"]
    head.to(DTYPES[args.save_dtype]).save_pretrained(out, vocab)
    if vocab is not None:
        vocab.save(out, coverage=covered)
    record = {
        "kind": "feature head (EAGLE-1" + (", fused layers" if head.config.fuse_layers else "")
                + (", training-time test" if args.ttt_steps > 1 else "") + ")",
        "fuse_layers": head.config.fuse_layers, "ttt_steps": args.ttt_steps, "authority": ref, "init": str(args.init[0]) if args.init else None, "records": str(args.records), "features": str(features),
        "params": params, "ffn": head.config.intermediate_size,
        "lm_head": "own" if head.lm_head is not None else "authority",
        "draft_vocab": len(vocab.ids) if vocab is not None else None, "draft_vocab_coverage": covered,
        "steps": steps, "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": lr, "seed": args.seed,
        "reg_weight": args.reg_weight, "cls_weight": args.cls_weight, "feature_noise": args.feature_noise,
        "feature_rms": rms, "train_positions": steps * args.batch_size * args.seq_len,
        "records_train_tokens": int(train.tokens.numel()), "records_held_out_tokens": int(held.tokens.numel()),
        "train_seconds": round(summary["train_seconds"], 1),
        "final_train_loss": summary["history"]["head"][-1][1] if summary["history"]["head"] else None,
        "history": summary["history"]["head"], "fuse_fit": getattr(args, "fuse_fit", None), "held_out": metrics, "drafting_greedy": drafting,
        "save_dtype": args.save_dtype, **run_record(args, device)}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    say(f"saved the head -> {out}")
