"""Feature heads (workers/head.py): a draft level over the authority's own last hidden states.

The worker against a naive reference (no cache, everything recomputed), the hand-off of the
authority's features under a rejected block, greedy identity through ``Cascade.from_topology``
with a head alone and beside other drafters (trees included), and the topology's errors. The
≥ 100k-draw distribution test is tests/test_head_distribution.py.
"""
from __future__ import annotations

import pytest
import torch

from cascade import Cascade, TopologyError, load_topology
from cascade.sampling import Sampling
from conftest import make_llama, write_topology
from head_util import copy_head, entries, hand_features
from hf_util import prompts_from_text, reference_greedy
from policies.fixed import FixedPolicy
from workers.draft_vocab import DraftVocab
from workers.head import FeatureHead, HeadWorker, random_head, shifted
from workers.hf import HFWorker


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """A 1-layer float64 authority, an independent drafter, and heads for the authority: a random
    one, and copies of the authority's own layer (see :func:`copy_head`), exact and perturbed."""
    root = tmp_path_factory.mktemp("heads")
    vocab = len(tokenizer)
    auth = make_llama(root / "auth", vocab, seed=1, hidden=32, layers=1, logit_scale=30.0,
                      dtype=torch.float64, tokenizer=tokenizer)
    tiny = make_llama(root / "tiny", vocab, seed=4, hidden=16, layers=1, logit_scale=30.0, dtype=torch.float64,
                      tokenizer=tokenizer)
    random_head(tiny, seed=6).save_pretrained(root / "tiny-head")
    random_head(auth, seed=3).save_pretrained(root / "random")
    random_head(auth, seed=7, num_attention_heads=4, num_key_value_heads=2).save_pretrained(root / "gqa")
    copy_head(auth, noise=0.0, feature_weight=0.0).save_pretrained(root / "copy")
    copy_head(auth, noise=0.3, seed=5).save_pretrained(root / "noisy")
    return root


def source_worker(models) -> HFWorker:
    return HFWorker(str(models / "auth"), dtype="float64", device="cpu")


def authority_features(model, tokens) -> torch.Tensor:
    """A fresh full pass: the authority's last hidden state (its LM head's input) at every position."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


def naive_logits(worker: HeadWorker, tokens: list[int], real: torch.Tensor, first: int) -> list[torch.Tensor]:
    """The head's logits after ``tokens[:t + 1]`` for ``t = first .. len - 1``, recomputed from
    scratch (no cache) entry by entry: position t takes the real feature of position t - 1 where
    ``real`` ``[r, hidden]`` has it, else the head's own prediction at t - 1 (zeros at 0)."""
    head = worker.head
    predicted: list[torch.Tensor] = []
    out = []
    with torch.no_grad():
        for t in range(len(tokens)):
            feats = [torch.zeros(real.shape[1], dtype=real.dtype)]
            for s in range(1, t + 1):
                feats.append(real[s - 1] if s - 1 < real.shape[0] else predicted[s - 1])
            embeds = worker.embed(torch.tensor([tokens[:t + 1]]))
            f_hat = head(torch.stack(feats)[None], embeds)[0, -1]
            predicted.append(f_hat)
            if t >= first:
                out.append(_wide_logits(worker, f_hat))
    return out


def _wide_logits(worker: HeadWorker, f_hat: torch.Tensor) -> torch.Tensor:
    """The head's authority-width logits from a predicted feature, computed here: the source's
    LM head (at the draft vocabulary's ids, if any), or the head's own over its draft vocabulary
    (in draft order); -inf outside a draft vocabulary."""
    vocab = worker.draft_vocab
    if vocab is None:
        return worker.lm_head(f_hat)
    rows = torch.full((worker.vocab_size,), float("-inf"), dtype=f_hat.dtype)
    own = worker.head.lm_head
    rows[vocab.ids] = own(f_hat) if own is not None else worker.lm_head(f_hat)[vocab.ids]
    return rows


def naive_outputs(worker: HeadWorker, tokens: list[int], real: torch.Tensor) -> torch.Tensor:
    """The head's predicted features at every position of ``tokens``, all fed with real features
    (``real``: positions 0 .. len - 2), in one causal pass without a cache."""
    with torch.no_grad():
        feats = torch.cat([torch.zeros_like(real[:1]), real])[None]
        return worker.head(feats, worker.embed(torch.tensor([tokens])))[0]


@pytest.mark.parametrize("kind", ["random", "gqa"])
def test_the_worker_equals_a_naive_recomputation_across_rollbacks(models, kind):
    source = source_worker(models)
    head = HeadWorker.load(models / kind, source, "auth")
    model = source.model
    sampling = Sampling(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    prompt_a, prompt_b = [5, 17, 30, 2, 99, 41], [7, 8, 9]
    passes = []
    original = source.score
    source.score = lambda *a: passes.append(a[1]) or original(*a)

    # 1. a fresh sequence: the source prefills it for its features, the head drafts 4 tokens
    assert hand_features(head, source, ["a"], [prompt_a]) == [0]
    assert len(passes) == 1
    draft = head.draft(["a"], [prompt_a], [4], sampling, [torch.rand(4, generator=gen, dtype=torch.float64)])[0]
    real = authority_features(model, prompt_a)[:-1]
    want = naive_logits(head, prompt_a + draft.tokens[:-1], real, len(prompt_a) - 1)
    assert len(draft.tokens) == 4
    for row, logits in zip(draft.probs, want):
        torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)

    # 2. the authority verifies the block (its pass keeps the features), keeps 2 and replaces the
    #    third: the hand-off needs no pass, drops the predicted entries, and the next draft is the
    #    naive one over real features
    block = draft.tokens
    source.score(["a"], [prompt_a + block], [len(block) + 1])
    replaced = (block[2] + 1) % source.vocab_size
    seq_a = prompt_a + block[:2] + [replaced]
    passes.clear()
    hand_features(head, source, ["a"], [seq_a])
    assert passes == []  # no extra authority pass
    tokens, real_count = entries(head, "a")
    assert tokens == seq_a[:real_count] and real_count == len(tokens)  # no predicted entry survives

    # 3. two sequences in one call (the new one prefilled), ragged lengths: both as if alone
    hand_features(head, source, ["a", "b"], [seq_a, prompt_b])
    drafts = head.draft(["a", "b"], [seq_a, prompt_b], [3, 5], sampling,
                        [torch.rand(3, generator=gen, dtype=torch.float64), torch.rand(5, generator=gen, dtype=torch.float64)])
    for seq, d in zip([seq_a, prompt_b], drafts):
        want = naive_logits(head, seq + d.tokens[:-1], authority_features(model, seq)[:-1], len(seq) - 1)
        for row, logits in zip(d.probs, want):
            torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)
    tokens, real_count = entries(head, "a")
    assert tokens[:len(seq_a)] == seq_a and real_count == len(seq_a)  # drafted entries are predicted ones
    head.release(["a", "b"])
    source.release(["a", "b"])
    assert head.cached_sequences() == 0 and source.cached_sequences() == 0
    assert source._features.seqs == {}


def test_a_sequence_run_past_its_features_uses_the_heads_predictions(models):
    """Features handed for a prefix only (a lower level's tokens the source has not scored yet):
    the head continues with its own predictions, as the naive reference does."""
    source = source_worker(models)
    head = HeadWorker.load(models / "random", source, "auth")
    seq = [3, 1, 4, 1, 5, 9, 2, 6]
    hand_features(head, source, ["s"], [seq], ends=[4])  # the source's features of positions 0..3 only
    draft = head.draft(["s"], [seq], [2], Sampling(temperature=1.0), [torch.tensor([0.3, 0.6], dtype=torch.float64)])[0]
    real = authority_features(source.model, seq)[:4]
    want = naive_logits(head, seq + draft.tokens[:-1], real, len(seq) - 1)
    for row, logits in zip(draft.probs, want):
        torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["random", "gqa"])
def test_a_heads_tree_equals_naive_chains(models, kind):
    """draft_tree, two sequences of different lengths in one call: every node's children are
    the top candidates of the head's logits after the root-to-node path, recomputed naively (a
    chain over that path: real features up to the handed ones, then the head's own); the
    head's entries afterwards are the sequences' own, as after a block."""
    from workers.trees import as_tree

    source = source_worker(models)
    head = HeadWorker.load(models / kind, source, "auth")
    seqs = [[5, 17, 30, 2, 99, 41], [7, 8, 9]]
    widths = [(3, 2, 2), (2, 1, 2, 1)]
    hand_features(head, source, ["a", "b"], seqs)
    trees = head.draft_tree(["a", "b"], seqs, widths)
    for s, seq, (tokens, parents), shape in zip(["a", "b"], seqs, trees, widths):
        as_tree((tokens, parents))  # well formed: parents before children
        real = authority_features(source.model, seq)[:-1]
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)

        def path_to(node):
            out = []
            while node >= 0:
                out.append(tokens[node])
                node = parents[node]
            return out[::-1]

        def check(node, depth):
            if depth == len(shape):
                assert node not in children
                return
            path = [] if node < 0 else path_to(node)
            logits = naive_logits(head, seq + path, real, len(seq) + len(path) - 1)[0]
            best = torch.sort(logits, descending=True, stable=True).indices[:shape[depth]].tolist()
            assert [tokens[c] for c in children[node]] == best
            for c in children[node]:
                check(c, depth + 1)

        check(-1, 0)
        assert entries(head, s) == (seq, len(seq))
    # a later block drafts as if no tree had been grown
    draft = head.draft(["a"], [seqs[0]], [2], Sampling(temperature=1.0), [torch.tensor([0.3, 0.6], dtype=torch.float64)])[0]
    want = naive_logits(head, seqs[0] + draft.tokens[:-1], authority_features(source.model, seqs[0])[:-1], 5)
    for row, logits in zip(draft.probs, want):
        torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("own", [True, False], ids=["own-lm-head", "source-lm-head"])
def test_a_head_over_a_trimmed_draft_vocabulary(models, tmp_path, own):
    """A head over a draft vocabulary (its own output head, or its source's restricted to it):
    rows -inf (probs 0) outside, the naive rows inside."""
    source = source_worker(models)
    ids = [13, 0, 29, 5, 37, 3, 19, 7, 31, 11, 23, 17]  # draft order is not id order
    head = random_head(source.model, seed=8, lm_head_rows=len(ids) if own else 0)
    head.save_pretrained(tmp_path / "trimmed", draft_vocab=DraftVocab(ids, source.vocab_size))
    worker = HeadWorker.load(tmp_path / "trimmed", source, "auth")
    seq = [5, 17, 30, 2]
    hand_features(worker, source, ["t"], [seq])
    draft = worker.draft(["t"], [seq], [3], Sampling(temperature=1.0), [torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)])[0]
    assert set(draft.tokens) <= set(ids)
    outside = torch.ones(source.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert float(draft.probs[:, outside].abs().max()) == 0.0
    want = naive_logits(worker, seq + draft.tokens[:-1], authority_features(source.model, seq)[:-1], len(seq) - 1)
    for row, logits in zip(draft.probs, want):
        torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)


def test_save_and_load_round_trip(models, tmp_path):
    head = FeatureHead.from_pretrained(models / "noisy")
    head.save_pretrained(tmp_path / "again")
    again = FeatureHead.from_pretrained(tmp_path / "again")
    for (k, v), (k2, v2) in zip(head.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    x = torch.randn(2, 5, head.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(head.double()(shifted(x), x), again.double()(shifted(x), x), rtol=0, atol=0)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("cache", ["solo", "pool", "per-sequence"])
def test_kept_features_follow_the_cache(models, lean, cache):
    """On every cache path of the transformers worker (a solo DynamicCache, the batched pool, the
    per-sequence fallback), under its lean forward and transformers' own: after chains partly
    rejected and trees settled, the features it keeps of a sequence are a fresh pass's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models / "auth", dtype=torch.float64)
    worker = HFWorker(model, device="cpu", lean=lean)
    assert (worker.lean is not None) == lean
    worker.keep_features()
    if cache == "per-sequence":
        worker._pool = None  # no pool: every sequence in its own cache
    ids = ["a", "b"] if cache != "solo" else ["a"]
    seqs = [[5, 17, 30, 2, 99, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15]][:len(ids)]

    def check(sequences):
        for s, seq in zip(ids, sequences):
            kept = worker._features.read(s, seq, 0)
            assert kept is not None, (s, cache)
            torch.testing.assert_close(kept, authority_features(model, seq)[:-1], rtol=0, atol=1e-10)
            got = worker.features([s], [seq], [2])[0]
            torch.testing.assert_close(got, kept[2:], rtol=0, atol=0)

    blocks = [[1, 2, 3], [4, 5, 6]]
    worker.score(ids, [s + b for s, b in zip(seqs, blocks)], [4] * len(ids))
    seqs = [s + t for s, t in zip(seqs, [[1, 77], [4, 5, 6, 88]])]  # a: 1 accepted, 2 rejected; b: all + bonus
    check(seqs)
    trees = [([20, 21, 22, 23], [-1, -1, 0, 2]), ([30, 31, 32], [-1, 0, 0])][:len(ids)]
    worker.score_tree(ids, seqs, trees)
    seqs = [s + t for s, t in zip(seqs, [[21, 50], [30, 32, 60]])]  # a: the second root child; b: a branch
    check(seqs)
    worker.score(ids, [s + [3, 3] for s in seqs], [3] * len(ids))
    seqs = [s + [3, 4] for s in seqs]
    check(seqs)
    if cache != "solo":  # a long sequence joins the running batch (the pool prefills it by itself)
        ids, seqs = ids + ["c"], seqs + [list(range(40, 60))]
        worker.score(ids, [s + [2] for s in seqs], [2] * len(ids))
        seqs = [s + [2, 9] for s in seqs]
        check(seqs)
    worker.release(ids)
    assert worker._features.seqs == {}


def test_features_asked_of_positions_never_computed(models):
    """A sequence the level has not seen is prefilled; one whose cache predates keep_features is
    recomputed (the kept features cannot have a gap)."""
    source = HFWorker(str(models / "auth"), dtype="float64", device="cpu")
    seq = [9, 8, 7, 6, 5, 4, 3]
    source.score(["old"], [seq], [1])
    source.keep_features()
    got = source.features(["old", "new"], [seq, seq[:4]], [0, 1])
    fresh = authority_features(source.model, seq)
    torch.testing.assert_close(got[0], fresh[:-1], rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], fresh[1:3], rtol=0, atol=1e-10)


def head_topology(models, tmp_path, head="noisy", policy=None, name="h.yaml", **extra):
    levels = [{"name": "head", "kind": "head", "model": str(models / head), "features_of": "auth"},  # head: or a path
              {"name": "auth", "model": str(models / "auth"), "dtype": "float64", "device": "cpu"}]
    data = {"name": "head", "levels": levels,
            "policy": policy or {"name": "fixed", "params": {"lookahead": {"head": 4}}}, **extra}
    return write_topology(tmp_path / name, data)


@pytest.mark.parametrize("setup", ["solo", "batch-rotating"])
def test_the_hand_off_under_a_rejected_block(models, tmp_path, tokenizer, setup):
    """Step by step through the engine: after every step, the authority's kept features of each
    committed sequence are those of a fresh full pass over it (a rejected block left none behind),
    and once handed over, the head holds real-feature entries only, equal to a naive recomputation.
    Solo (a DynamicCache), and three sequences in the pool under a policy that turns between the
    head, a tree of the drafter's, the head drafting for the drafter, a tree of the head's and the
    n-gram level."""
    if setup == "solo":
        prompts, topo, policy = [tokenizer.encode("def fibonacci(n):\n")], head_topology(models, tmp_path), None
    else:
        prompts = prompts_from_text(tokenizer, 3)
        lookahead = {"ngram": 3, "head": 4, "tiny": 5}
        topo = mixed_topology(models, tmp_path, {"name": "fixed", "params": {"lookahead": lookahead}})
        policy = RotatingPolicy(lookahead)
    partly_rejected = 0
    with Cascade.from_topology(topo) as c:
        head, auth = c.workers["head"], c.workers["auth"]
        batch = c.batch(policy)
        states = [batch.add(c.request(p, max_new_tokens=40, temperature=0.0)) for p in prompts]
        before = {s.seq_id: (0, 0) for s in states}
        while any(s.finish_reason is None for s in states):
            batch.step()
            for prompt, state in zip(prompts, states):
                edge = state.stats.edges.get("head->auth")
                if edge is not None:
                    proposed, accepted = edge.proposed - before[state.seq_id][0], edge.accepted - before[state.seq_id][1]
                    before[state.seq_id] = (edge.proposed, edge.accepted)
                    partly_rejected += 0 < accepted < proposed
                if state.finish_reason is not None:  # released
                    assert state.seq_id not in auth._features.seqs and entries(head, state.seq_id) == ([], 0)
                    continue
                seq = prompt + state.generated
                kept = auth._features.read(state.seq_id, seq, 0)
                assert kept is not None  # held: no pass needed
                torch.testing.assert_close(kept, authority_features(auth.model, seq)[:-1], rtol=0, atol=1e-10)
                hand_features(head, auth, [state.seq_id], [seq])
                tokens, real = entries(head, state.seq_id)
                assert real == len(tokens) and tokens == seq[:real]
                # the head's entries once fed (the next draft's first pass) are the naive recomputation's
                head._next_logits([state.seq_id], [seq])
                naive = naive_outputs(head, seq, authority_features(auth.model, seq)[:-1])
                torch.testing.assert_close(head._seqs[state.seq_id].out, naive, rtol=0, atol=1e-10)
        for prompt, state in zip(prompts, states):
            assert state.generated == reference_greedy(models / "auth", prompt, 40)
    assert partly_rejected > 0, "no block was partly rejected: the test did not test the hand-off"


@pytest.mark.parametrize("head", ["copy", "noisy", "random"])
def test_greedy_identity_with_a_heads_tree(models, tmp_path, tokenizer, head):
    """The head grows a tree, the authority scores it in one pass and walks it: alone and in a
    batch, the output is plain greedy decoding's; the copy of the authority's layer has its
    first choice taken at every depth."""
    prompts = prompts_from_text(tokenizer, 3)
    policy = {"name": "fixed", "params": {"lookahead": {"head": 3}, "tree": {"head": [2, 2, 1]}}}
    with Cascade.from_topology(head_topology(models, tmp_path, head=head, policy=policy)) as c:
        solo = [c.generate(p, max_new_tokens=32, temperature=0.0) for p in prompts]
        batched = c.generate(prompts, max_new_tokens=32, temperature=0.0, batch_size=3)
        assert c.workers["head"].cached_sequences() == 0
    for p, g, b in zip(prompts, solo, batched):
        want = reference_greedy(models / "auth", p, 32)
        assert g.token_ids == want and b.token_ids == want
    edges = [g.stats.edges["head->auth"] for g in solo]
    assert all(e.tree_nodes > 0 for e in edges)
    # one authority pass a step, plus the prompt's features before the first: the hand-off after
    # a tree reads the accepted path's features the tree pass kept, and is not priced as a pass
    assert all(g.stats.levels["auth"].forward_passes <= g.stats.steps + 1 for g in solo)
    if head == "copy":
        assert all(e.accepted == e.proposed and sum(e.accepted_by_rank[1:]) == 0 for e in edges)


@pytest.mark.parametrize("head", ["copy", "noisy", "random"])
def test_greedy_identity_head_and_authority(models, tmp_path, tokenizer, head):
    prompts = prompts_from_text(tokenizer, 4)
    with Cascade.from_topology(head_topology(models, tmp_path, head=head)) as c:
        solo = [c.generate(p, max_new_tokens=32, temperature=0.0) for p in prompts]
        batched = c.generate(prompts, max_new_tokens=32, temperature=0.0, batch_size=4)  # the pool
        assert c.workers["head"].cached_sequences() == 0 and c.workers["auth"]._features.seqs == {}
    for p, g, b in zip(prompts, solo, batched):
        want = reference_greedy(models / "auth", p, 32)
        assert g.token_ids == want and b.token_ids == want
    edge = solo[0].stats.edges["head->auth"]
    assert edge.proposed > 0
    if head == "copy":  # the authority's own layer: every greedy draft accepted
        assert all(g.stats.edges["head->auth"].accepted == g.stats.edges["head->auth"].proposed for g in solo)


def mixed_topology(models, tmp_path, policy, name="mixed.yaml", features_of="auth", head="noisy"):
    levels = [{"name": "ngram", "kind": "ngram"},
              {"name": "head", "kind": "head", "model": str(models / head), "features_of": features_of},
              {"name": "tiny", "model": str(models / "tiny"), "dtype": "float64", "device": "cpu"},
              {"name": "auth", "model": str(models / "auth"), "dtype": "float64", "device": "cpu"}]
    edges = [["ngram", "auth"], ["head", "auth"], ["head", "tiny"], ["ngram", "tiny"], ["tiny", "auth"]]
    return write_topology(tmp_path / name, {"name": "mixed", "levels": levels, "edges": edges, "policy": policy})


PATHS = [["head", "auth"], ["head", "tiny", "auth"], ["ngram", "auth"], ["tiny", "auth"], ["ngram", "tiny", "auth"]]


def test_greedy_identity_beside_other_drafters(models, tmp_path, tokenizer):
    """A head beside the n-gram level and an independent drafter: every path, switching path
    from step to step (the authority's kept features follow whatever scored last), the head
    drafting for the drafter (past the authority's features it feeds its own predictions),
    trees from the drafter, and ``auto`` choosing per step."""
    prompts = prompts_from_text(tokenizer, 3)
    lookahead = {"ngram": 3, "head": 3, "tiny": 5}
    want = [reference_greedy(models / "auth", p, 40) for p in prompts]
    topo = mixed_topology(models, tmp_path, {"name": "fixed", "params": {"lookahead": lookahead}})
    with Cascade.from_topology(topo) as c:
        for path in PATHS:
            policy = FixedPolicy(lookahead=lookahead, path=path)
            got = c.generate(prompts, max_new_tokens=40, temperature=0.0, policy=policy, batch_size=3)
            assert [g.token_ids for g in got] == want, path
        got = [c.generate(p, max_new_tokens=40, temperature=0.0, policy=RotatingPolicy(lookahead)) for p in prompts]
        assert [g.token_ids for g in got] == want
        got = c.generate(prompts, max_new_tokens=40, temperature=0.0, policy=RotatingPolicy(lookahead), batch_size=3)
        assert [g.token_ids for g in got] == want
        assert got[0].stats.edges["tiny->auth"].tree_nodes > 0
        got = c.generate(prompts, max_new_tokens=40, temperature=0.0, policy="auto", batch_size=3)
        assert [g.token_ids for g in got] == want


@pytest.mark.parametrize("stand_in", ["head", "tiny"])
def test_greedy_identity_with_a_stand_in_for_prompt_lookup(models, tmp_path, tokenizer, stand_in):
    """`ngram -> auth` with a stand-in: where prompt lookup finds no match, the head (or the
    drafter) drafts that step's block instead — alone and in a batch, the output is plain greedy
    decoding's, both edges propose, and the stand-in's blocks are counted on its own edge."""
    prompts = prompts_from_text(tokenizer, 3)
    lookahead = {"ngram": 3, "head": 3, "tiny": 3}
    want = [reference_greedy(models / "auth", p, 40) for p in prompts]
    topo = mixed_topology(models, tmp_path, {"name": "fixed", "params": {"lookahead": lookahead}})
    with Cascade.from_topology(topo) as c:
        policy = FixedPolicy(lookahead=lookahead, path=["ngram", "auth"], stand_in={"ngram": stand_in})
        solo = [c.generate(p, max_new_tokens=40, temperature=0.0, policy=policy) for p in prompts]
        batched = c.generate(prompts, max_new_tokens=40, temperature=0.0, policy=policy, batch_size=3)
    assert [g.token_ids for g in solo] == want and [g.token_ids for g in batched] == want
    for g in solo + batched:
        edge = g.stats.edges[f"{stand_in}->auth"]
        assert edge.proposed > 0 and g.stats.levels[stand_in].tokens_proposed == edge.proposed
    assert sum(g.stats.edges["ngram->auth"].proposed for g in solo if "ngram->auth" in g.stats.edges) > 0


def test_greedy_identity_head_reading_a_middle_level(models, tmp_path, tokenizer):
    """A head may read any hf level: here the drafter it drafts for."""
    prompts = prompts_from_text(tokenizer, 2)
    lookahead = {"head": 3, "tiny": 5}
    topo = mixed_topology(models, tmp_path, {"name": "fixed", "params": {"lookahead": lookahead,
                                                                         "path": ["head", "tiny", "auth"]}},
                          features_of="tiny", head="tiny-head")
    with Cascade.from_topology(topo) as c:
        got = c.generate(prompts, max_new_tokens=40, temperature=0.0, batch_size=2)
    assert [g.token_ids for g in got] == [reference_greedy(models / "auth", p, 40) for p in prompts]
    assert got[0].stats.edges["head->tiny"].proposed > 0


def test_auto_prices_trees_for_a_head_and_not_for_the_ngram_level(models, tmp_path):
    """A head grows trees as a drafter does (its own pass per depth); the n-gram level does not."""
    from policies import from_spec
    from policies.base import PlanContext

    topo = load_topology(mixed_topology(models, tmp_path, {"name": "auto"}))
    auto = from_spec({"name": "auto"})
    auto.bind(topo.graph, topo.authority)
    ctx = PlanContext(topo.graph, topo.authority, 16, 0, frozenset(topo.graph), batch_size=1)
    assert auto._shapes(ctx, ("ngram", "auth")) == [None]
    for path in (("head", "auth"), ("tiny", "auth")):
        assert auto._shapes(ctx, path)[0] is None and len(auto._shapes(ctx, path)) > 1


class RotatingPolicy(FixedPolicy):
    """Fixed, but the path turns every step: head -> auth, a tree of tiny's -> auth, head -> tiny
    -> auth, a tree of the head's -> auth, ngram -> auth: the authority's kept features and the
    head's entries follow chains, trees and skipped steps."""

    PLANS = [(("head", "auth"), {}), (("tiny", "auth"), {"tiny": (2, 2, 1)}), (("head", "tiny", "auth"), {}),
             (("head", "auth"), {"head": (2, 2, 1)}), (("ngram", "auth"), {})]

    def __init__(self, lookahead):
        super().__init__(lookahead=lookahead)
        self.turn = 0

    def plan(self, ctx):
        from policies.base import StepPlan

        path, tree = self.PLANS[self.turn % len(self.PLANS)]
        self.turn += 1
        return StepPlan(path=path, lookahead={n: self.lookahead_for(n) for n in path[:-1]}, tree=tree)


# -- errors --------------------------------------------------------------------------------------


def expect_error(tmp_path, data, *fragments):
    path = write_topology(tmp_path / "bad.yaml", data)
    with pytest.raises(TopologyError) as info:
        load_topology(path)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def levels_with(models, head: dict):
    return [{"name": "ngram", "kind": "ngram"},
            {"name": "head", "kind": "head", "model": str(models / "noisy"), **head},
            {"name": "auth", "model": str(models / "auth"), "dtype": "float64", "device": "cpu"}]


@pytest.mark.parametrize("head,edges,fragments", [
    ({"features_of": "nope"}, None, ["levels[1].features_of: unknown level 'nope'"]),
    ({"features_of": "ngram"}, None, ["levels[1].features_of: 'ngram' is a 'ngram' level"]),
    ({}, None, ["levels[1]", "needs 'features_of'"]),
    ({"features_of": "auth", "dtype": "float64"}, None, ["levels[1]", "takes no 'dtype'"]),
    ({"features_of": "auth"}, [["ngram", "head"], ["head", "auth"]], ["levels[1] (head)", "can only propose"]),
], ids=["missing", "not-hf", "no-features_of", "dtype", "verifier"])
def test_bad_head_topologies(models, tmp_path, head, edges, fragments):
    data = {"levels": levels_with(models, head)}
    if edges is not None:
        data["edges"] = edges
    else:
        data["edges"] = [["ngram", "auth"], ["head", "auth"]]
    expect_error(tmp_path, data, *fragments)


def test_a_head_cannot_be_the_authority_and_runs_beside_its_source_under_ray(models, tmp_path):
    """Under ``backend: ray`` a head lives where its source runs: in its actor (no actor or
    bundle of its own), or in the driver with it; a head named in ``ray.in_driver`` without its
    source, or given resources, is a named error (checked at load, and by from_topology for
    backend="ray" before anything starts). Running under Ray: tests/test_ray.py."""
    from cascade.backends.ray import actor_levels, in_driver_levels, level_bundles

    expect_error(tmp_path, {"levels": [{"name": "auth", "model": str(models / "auth")},
                                       {"name": "head", "kind": "head", "model": str(models / "noisy"),
                                        "features_of": "auth"}]},
                 "levels[1] (head)", "can only propose")
    edges = [["ngram", "auth"], ["head", "auth"]]
    ray = {"levels": levels_with(models, {"features_of": "auth"}), "backend": "ray", "edges": edges}
    topo = load_topology(write_topology(tmp_path / "ray.yaml", ray))
    assert [lv.name for _, lv in actor_levels(topo)] == ["auth"] and len(level_bundles(topo)) == 1
    assert in_driver_levels(topo) == {"ngram"}
    topo = load_topology(write_topology(tmp_path / "driver.yaml", {**ray, "ray": {"in_driver": ["auth"]}}))
    assert in_driver_levels(topo) == {"ngram", "auth", "head"} and actor_levels(topo) == []
    expect_error(tmp_path, {**ray, "ray": {"in_driver": ["head"]}},
                 "ray.in_driver[0]: the feature head 'head' runs where its features_of level 'auth' runs",
                 "never cross the wire")
    expect_error(tmp_path, {**ray, "levels": levels_with(models, {"features_of": "auth",
                                                                  "resources": {"num_cpus": 1}})},
                 "levels[1].resources: the feature head 'head' runs in the actor of its features_of level 'auth'")
    # the same topology loads in process: in_driver and resources mean nothing there
    load_topology(write_topology(tmp_path / "local.yaml", {**ray, "backend": "local", "ray": {"in_driver": ["head"]}}))
    with pytest.raises(TopologyError, match=r"ray.in_driver\[0\]: the feature head 'head'"):
        Cascade.from_topology(tmp_path / "local.yaml", backend="ray")


def test_a_head_for_another_model_or_folder_is_refused(models, tmp_path):
    expect_error(tmp_path, {"levels": levels_with(models, {"features_of": "auth", "model": str(models / "auth")}),
                            "edges": [["ngram", "auth"], ["head", "auth"]]},
                 "levels[1].model", "head_config.json")
    other = make_llama(tmp_path / "wide", 320, seed=9, hidden=48, dtype=torch.float64)
    random_head(other).save_pretrained(tmp_path / "wide-head")
    with pytest.raises(TopologyError, match=r"levels\[0\].model: head_config.json: hidden_size 48 differs from its "
                                            r"features_of level's \(auth\) 32"):
        Cascade.from_topology(head_topology(models, tmp_path, head=tmp_path / "wide-head"))
