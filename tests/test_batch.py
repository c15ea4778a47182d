"""Batched generation: ragged acceptance per sequence, continuous batching, exactness."""
from __future__ import annotations

import pytest

from cascade import Cascade, RequestError
from conftest import family_topology, write_topology
from draws import NGRAM_POLICY, NGRAM_PROMPT, RESIDUAL_CASES, table_topology
from hf_util import prompts_from_text


class ForwardCounter:
    """Forward passes of a model: each one calls its LM head once (HF forward and lean forward)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.get_output_embeddings().register_forward_hook(lambda *_: setattr(self, "count", self.count + 1))


def test_batched_greedy_equals_solo_greedy(family, tokenizer, tmp_path):
    topo = write_topology(tmp_path / "b.yaml", family_topology(
        family, ["tiny", "small", "medium", "large"], ngram=True,
        policy={"name": "fixed", "params": {"lookahead": {"ngram": 3, "tiny": 3, "small": 5, "medium": 7}}}))
    prompts = prompts_from_text(tokenizer, 10)  # different lengths
    with Cascade.from_topology(topo) as c:
        counter = ForwardCounter(c.workers["large"].model)
        solo = [g.token_ids for g in c.generate(prompts, max_new_tokens=40, temperature=0.0)]
        solo_passes = counter.count
        batched = c.generate(prompts, max_new_tokens=40, temperature=0.0, batch_size=4)
        batched_passes = counter.count - solo_passes
    assert [g.token_ids for g in batched] == solo
    assert all(g.finish_reason == "length" for g in batched)
    # forward passes were shared: far fewer authority calls than one per sequence and step
    assert batched_passes < 0.5 * solo_passes
    assert sum(g.stats.authority_passes for g in batched) == solo_passes  # per-request accounting


@pytest.mark.parametrize("coupling", [None, "residual"], ids=["keyed", "residual"])
@pytest.mark.parametrize("depth,temperature,top_k,top_p,draft", RESIDUAL_CASES + [(3, 1.0, 0, 1.0, "ngram")])
def test_batched_sampling_reproduces_solo_tokens_for_the_same_seeds(tmp_path, depth, temperature, top_k, top_p, draft,
                                                                    coupling):
    """Each sequence draws from its own generator (residual) or its own keys (keyed: a seed and
    no coupling), so batching changes no random draw: on every topology the residual
    distribution tests draw batched (test_distribution.py), batched == solo, under both rules."""
    if draft == "ngram":
        topo = table_topology(tmp_path, depth, policy=NGRAM_POLICY, ngram=True)
        prompts = [NGRAM_PROMPT + [i % 6] for i in range(40)]
    else:
        topo = table_topology(tmp_path, depth, draft_sampling=draft)
        prompts = [[i % 6] for i in range(40)]
    sampling = dict(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, seed=3, coupling=coupling)
    with Cascade.from_topology(topo) as c:
        solo = [g.token_ids for g in c.generate(prompts, **sampling)]
        batched = [g.token_ids for g in c.generate(prompts, **sampling, batch_size=16)]
    assert batched == solo


def test_continuous_batching_api(family, tokenizer, tmp_path):
    topo = write_topology(tmp_path / "c.yaml", family_topology(family, ["tiny", "large"]))
    with Cascade.from_topology(topo) as c:
        batch = c.batch()
        first = batch.add(c.request("def f(x):\n", max_new_tokens=6, temperature=0.0))
        committed: dict[str, list[int]] = {}
        for state, new in batch.step():
            committed.setdefault(state.seq_id, []).extend(new)
        late = batch.add(c.request("import os\n", max_new_tokens=20, temperature=0.0))  # joins between steps
        sizes = []
        while batch.active:
            sizes.append(len(batch.active))
            for state, new in batch.step():
                committed.setdefault(state.seq_id, []).extend(new)
        assert first.finish_reason == "length" and late.finish_reason == "length"
        assert committed[first.seq_id] == first.generated and len(first.generated) == 6
        assert sizes[0] == 2 and sizes[-1] == 1  # the short request left, the long one went on
        alone = c.generate("import os\n", max_new_tokens=20, temperature=0.0)
        assert c.result(late).token_ids == alone.token_ids


def test_batch_size_is_validated(family, tmp_path):
    topo = write_topology(tmp_path / "v.yaml", family_topology(family, ["large"]))
    with Cascade.from_topology(topo) as c, pytest.raises(RequestError, match="^batch_size"):
        c.generate(["a", "b"], batch_size=0)
