"""Sequence-level unlikelihood training: teach a model not to loop under greedy decoding.

A small causal LM trained by maximum likelihood alone settles, under greedy decoding, into its
single most likely line and repeats it: the bundled ``large`` did so on 97 % of the held-out
prompts. Maximum likelihood never sees the model's own continuations, so it never learns that
they loop. Sequence-level unlikelihood training (Welleck et al., 2019, "Neural Text Generation
with Unlikelihood Training") does: from a prefix of real text the model writes a greedy
continuation, every token of the continuation that sits inside a repeated n-gram becomes a
negative candidate at its position, and the loss pushes its probability down,

    L_UL = - sum_t  [t is in a repeated n-gram] * log(1 - p(x_t | x_<t))   (averaged over tokens)

Steps alternate with plain cross-entropy steps on the corpus, which keep the model a good model
of the text. This changes the *model* and so its distribution; cascade's exactness contract is
about decoding *a given* model, which is untouched.

``cascade distill --teacher none --init DIR --unlikelihood-every K`` runs it (see ``--help``).
"""
from __future__ import annotations

from cascade.repetition import NGRAM  # the n of the repetition measure the benches report


def repeated_ngram_mask(ids, n: int = NGRAM):
    """Bool mask [batch, len] of the tokens of ``ids`` [batch, len] that lie inside an ``n``-gram
    already seen earlier in the same row (every one of the gram's ``n`` tokens is marked)."""
    import torch

    rows = ids.tolist()
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for r, row in enumerate(rows):
        seen: set[tuple[int, ...]] = set()
        for i in range(n - 1, len(row)):
            gram = tuple(row[i - n + 1:i + 1])
            if gram in seen:
                mask[r, i - n + 1:i + 1] = True
            seen.add(gram)
    return mask


def greedy_rollout(model, prefix, new_tokens: int):
    """The model's greedy continuation [batch, new_tokens] of ``prefix`` [batch, P] (no grad)."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    model.train(was_training)
    return out[:, prefix.size(1):]


def unlikelihood_loss(logits, targets, negative):
    """Mean over positions of ``-log(1 - p(target))`` where ``negative`` [batch, len] is set.

    ``logits`` [batch, len, vocab] (float32) predict ``targets`` [batch, len]."""
    import torch

    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    one_minus_p = torch.clamp(1.0 - logp.exp(), min=1e-5)
    return -(torch.log(one_minus_p) * negative.float()).mean()


def rollout_batch(model, batch, prefix_len: int, new_tokens: int, n: int = NGRAM):
    """(input_ids, targets, negative mask, repetition share) for one unlikelihood step on real-text
    ``batch`` [B, >= prefix_len]: the model's greedy continuation of each row's first
    ``prefix_len`` tokens; positions predict the continuation's tokens."""
    import torch

    prefix = batch[:, :prefix_len]
    cont = greedy_rollout(model, prefix, new_tokens)
    seq = torch.cat([prefix, cont], dim=1)
    negative = repeated_ngram_mask(cont, n)
    # position prefix_len - 1 + j predicts cont[:, j]
    return seq[:, :-1], cont, negative, negative.float().mean().item()
