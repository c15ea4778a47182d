"""Helpers for the feature-head tests (test_head.py, test_head_distribution.py, test_head_eagle3.py,
test_distill_head.py, and the heads under Ray: test_ray.py, test_ray_counts.py)."""
from __future__ import annotations

from collections import Counter

import torch
from transformers import AutoModelForCausalLM

import workers.head
from cascade import Cascade
from stats_util import chi_square_pvalue, total_variation
from workers.head import FeatureHead, random_head

# The distribution tests' setup: a float64 authority over 8 tokens, the first two tokens drawn
# after PROMPT, BATCH requests at a time.
VOCAB = 8
PROMPT = [1, 2, 3]
BATCH = 256


def hand_features(head, source, seq_ids, token_ids, ends=None) -> list[int]:
    """The engine's hand-off (:meth:`workers.head.HeadWorker.hand_off`) of each sequence's
    features up to position ``ends[b] - 1`` (default: all but the last position, all a head
    ever needs); the sequences (indices) the source was asked for features."""
    return head.hand_off(source, seq_ids, token_ids, [len(t) - 1 for t in token_ids] if ends is None else ends)


def entries(head, seq_id: str) -> tuple[list[int], int]:
    """The tokens of a sequence's entries in a head's cache and how many lead with real features."""
    state = head._seqs.get(seq_id)
    return ([], 0) if state is None else (list(state.tokens), state.real)


def copy_head(auth_dir, noise: float, seed: int = 0, feature_weight: float = 0.05) -> FeatureHead:
    """A head whose decoder layer is the (1-layer) authority's own, perturbed by ``noise``, and
    whose ``fc`` passes the token's embedding through plus ``feature_weight`` x a random map of
    the feature. With neither, it recomputes the authority's hidden state before its final norm,
    whose LM-head argmax is the authority's (the norm's weights are ones at init: a positive
    rescaling): greedy drafts the authority accepts, and sampled ones it partly accepts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(auth_dir, dtype=torch.float64)
    head = random_head(model, seed=seed, intermediate_size=model.config.intermediate_size).to(torch.float64)
    hidden = model.config.hidden_size
    with torch.no_grad():
        head.layer.load_state_dict(model.model.layers[0].state_dict())
        for p in head.layer.parameters():
            p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.weight[:, :hidden] = torch.randn(hidden, hidden, dtype=torch.float64) * feature_weight / hidden ** 0.5
        head.fc.bias.zero_()
    return head


def distill_args(root, out, work, *extra):
    return ["distill", "--head", "--records", str(root / "rec"), "--draft-vocab", "64", "--out", str(out),
            "--steps", "60", "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3", "--work-dir", str(work),
            "--no-progress", "--threads", "1", "--amp", "none", "--teacher-dtype", "float32", "--save-dtype", "float32",
            "--eval-drafts", "32",
            *extra]


def exact_pairs(model_dir) -> dict:
    """The authority's distribution of the first two tokens (T = 1), by enumeration."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
        second = torch.softmax(model(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1], -1)
    return {(a, b): float(first[a] * second[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


def draw(topo: str, n: int, seed: int, edge: str = "head->auth", also: list | None = None):
    """(counts of the first two tokens, proposed and accepted on ``edge``, second choices taken);
    ``also`` gets the proposed count on ``ngram->auth``."""
    with Cascade.from_topology(topo) as c:
        results = c.generate([PROMPT] * n, max_new_tokens=4, temperature=1.0, seed=seed, batch_size=BATCH,
                             coupling="residual")
    counts = Counter(tuple(g.token_ids[:2]) for g in results)
    if also is not None:
        also.append(sum(g.stats.edges["ngram->auth"].proposed for g in results if "ngram->auth" in g.stats.edges))
    edges = [g.stats.edges[edge] for g in results if edge in g.stats.edges]
    proposed, accepted = sum(e.proposed for e in edges), sum(e.accepted for e in edges)
    siblings = sum(sum(e.accepted_by_rank[1:]) for e in edges)  # a tree's second choices and below, taken
    return counts, proposed, accepted, siblings


def check(counts, expected, n, tv_bound):
    stat, pvalue = chi_square_pvalue(counts, expected, n)
    tv = total_variation(counts, expected, n)
    assert pvalue > 1e-4, (stat, pvalue, tv)
    assert tv < tv_bound, (stat, pvalue, tv)


def misreport_head_probs(monkeypatch) -> None:
    """The head samples as before but reports uniform ``draft_probs``."""
    real = workers.head.HeadWorker.draft

    def misreported(self, *args, **kwargs):
        drafts = real(self, *args, **kwargs)
        for d in drafts:
            d.probs = torch.full_like(d.probs, 1.0 / d.probs.shape[-1])
        return drafts

    monkeypatch.setattr(workers.head.HeadWorker, "draft", misreported)


# -- feature heads under Ray (test_ray.py, test_ray_counts.py) -------------------------------------

HEAD_LOOKAHEAD = {"ngram": 3, "head": 3, "thead": 3, "tiny": 5}


def ray_head_topology(root, tokenizer):
    """As tests/test_head.py's: a 1-layer float64 authority ``auth`` read by ``head`` (a perturbed
    copy of its own layer: partly accepted drafts), an independent drafter ``tiny`` read by
    ``thead`` (random). ``auth`` runs in an actor, ``head`` in it; ``tiny`` runs in the driver
    (``ray.in_driver``), ``thead`` beside it, and the n-gram level too. Heads take no resources.
    The topology file's path, under ``root``."""
    from conftest import make_llama, write_topology

    vocab = len(tokenizer)
    auth = make_llama(root / "auth", vocab, seed=1, hidden=32, layers=1, logit_scale=30.0, dtype=torch.float64,
                      tokenizer=tokenizer)
    tiny = make_llama(root / "tiny", vocab, seed=4, hidden=16, layers=1, logit_scale=30.0, dtype=torch.float64,
                      tokenizer=tokenizer)
    copy_head(auth, noise=0.3, seed=5).save_pretrained(root / "noisy")
    random_head(tiny, seed=6).save_pretrained(root / "tiny-head")
    levels = [{"name": "ngram", "kind": "ngram"},
              {"name": "head", "kind": "head", "model": str(root / "noisy"), "features_of": "auth"},
              {"name": "thead", "kind": "head", "model": str(root / "tiny-head"), "features_of": "tiny"},
              {"name": "tiny", "model": str(tiny), "dtype": "float64", "device": "cpu",
               "resources": {"num_cpus": 0.1}},
              {"name": "auth", "model": str(auth), "dtype": "float64", "device": "cpu",
               "resources": {"num_cpus": 0.1}}]
    edges = [["ngram", "auth"], ["head", "auth"], ["head", "tiny"], ["thead", "tiny"], ["ngram", "tiny"],
             ["tiny", "auth"]]
    policy = {"name": "fixed", "params": {"lookahead": HEAD_LOOKAHEAD, "path": ["head", "auth"]}}
    return write_topology(root / "heads.yaml", {"name": "heads", "levels": levels, "edges": edges, "policy": policy,
                                                "backend": "ray", "ray": {"max_restarts": 2, "call_timeout_s": 120,
                                                                        "in_driver": ["tiny"]}})
