"""Helpers for the feature-head tests (test_head.py, test_head_distribution.py)."""
from __future__ import annotations

import torch

from workers.head import FeatureHead, random_head


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
