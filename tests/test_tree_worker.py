"""Workers score a tree of candidate tokens in one forward pass (issue 29): a tree row equals the
row of its root-to-node path scored as a chain, on every HF path (solo DynamicCache, the pool,
the per-sequence fallback; the lean forward and transformers' own); and after the next call a
cache holds exactly what it would hold had only the accepted path been scored, as a chain."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cascade.sampling import Sampling
from table_worker import TableWorker
from told import Told
from workers.base import Worker
from workers.draft_vocab import DraftVocab
from workers.hf import HFWorker
from workers.trees import accepted_path, as_tree, leaf_paths

TOL = 1e-10
EAGER_TOL = 1e-6  # transformers' eager attention takes its softmax in float32
VOCAB = 61


def make(seed: int = 0, vocab: int = VOCAB, attn: str = "sdpa", noise_from=None, noise: float = 0.0):
    """A small random Llama (grouped-query attention), float64, in eval mode; or a noisy copy of
    ``noise_from`` (a drafter that partly agrees with it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = attn
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    if noise_from is not None:
        model.load_state_dict(noise_from.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
    return model


@pytest.fixture(scope="module")
def model():
    return make()


@pytest.fixture(scope="module")
def eager():
    return make(attn="eager")


def chain_rows(model, prefix, tree) -> torch.Tensor:
    """The rows a tree should get, from its root-to-leaf paths scored as chains without a cache."""
    tokens, parents = as_tree(tree)
    rows = torch.empty(len(tokens) + 1, model.config.vocab_size, dtype=torch.float64)
    for path in leaf_paths(parents):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([list(prefix) + [tokens[i] for i in path]]),
                           use_cache=False).logits[0, -len(path) - 1:]
        rows[[0] + [1 + i for i in path]] = logits
    return rows


def random_tree(rng, width: int, depth: int, vocab: int = VOCAB):
    """Breadth first: the root gets 1..width children, every other node 0..width, down to ``depth``
    levels; siblings distinct."""
    tokens, parents, queue = [], [], [(-1, 0)]
    while queue:
        node, d = queue.pop(0)
        if d == depth:
            continue
        for token in rng.sample(range(vocab), rng.randint(1 if node < 0 else 0, width)):
            tokens.append(token)
            parents.append(node)
            queue.append((len(tokens) - 1, d + 1))
    return tokens, parents


def shapes(rng) -> dict[str, tuple[list[int], list[int]]]:
    t = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    return {
        "one-node": (t(1), [-1]),
        "chain-4": (t(4), [-1, 0, 1, 2]),
        "width-3-depth-1": (t(3), [-1, -1, -1]),
        "full-2x2": (t(6), [-1, -1, 0, 0, 1, 1]),
        "unbalanced-depth-first": (t(8), [-1, 0, 1, 1, -1, 4, 0, 2]),
        "same-token-siblings": ([7, 7, 3, 9], [-1, -1, 0, 1]),
        "random-width-3-depth-4": random_tree(rng, 3, 4),
    }


def seqs(rng, n: int, lo: int = 2, hi: int = 30) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def path_tokens(tree, path) -> list[int]:
    return [tree[0][i] for i in path]


def held(worker, s: str):
    """(positions, [(keys, values) [heads, positions, head_dim] per layer]) the worker holds for ``s``,
    with no tree pending; for a pool row, its valid columns in order (nothing else valid)."""
    if s in worker._caches.seqs:
        entry = worker._caches.seqs[s]
        assert entry.tree is None
        return entry.length, [(layer.keys[0], layer.values[0]) for layer in entry.cache.layers]
    pool = worker._pool
    r = pool.row_of[s]
    assert r not in pool.trees
    cols = torch.tensor(pool.cols[r], dtype=torch.long)
    assert len(cols) == int(pool.valid[r].sum()) and bool(pool.valid[r, cols].all())
    return len(cols), [(k[r][:, cols], v[r][:, cols]) for k, v in zip(pool.kbufs, pool.vbufs)]


def same_cache(a, b, ids):
    for s in ids:
        (ta, kva), (tb, kvb) = held(a, s), held(b, s)
        assert ta == tb
        for (ka, va), (kb, vb) in zip(kva, kvb):
            assert ka.shape == kb.shape
            torch.testing.assert_close(ka, kb, rtol=0, atol=TOL)
            torch.testing.assert_close(va, vb, rtol=0, atol=TOL)


def worker_for(model, path: str, lean: bool = True) -> HFWorker:
    worker = HFWorker(model, lean=lean)
    if path == "per-sequence":
        worker._pool = None  # no pool: every sequence in its own cache
    return worker


# -- (a) tree rows are the chain rows ------------------------------------------------------------

@pytest.mark.parametrize("forward", ["lean", "transformers", "eager"])
def test_solo_tree_rows_equal_chain_rows(model, eager, forward):
    """Batch 1 (its own DynamicCache): every shape, fresh and after a long cached prefix with an
    uncached tail, and after the previous tree (which the next call settles)."""
    m = eager if forward == "eager" else model
    tol = EAGER_TOL if forward == "eager" else TOL
    worker = HFWorker(m, lean=forward == "lean")
    assert (worker.lean is not None) == (forward == "lean")
    assert worker._tree_support() == ("float" if forward == "eager" else "bool")
    rng = random.Random(0)
    for name, tree in shapes(rng).items():
        prompt = seqs(rng, 1, 3, 6)[0]
        rows = worker.score_tree([name], [prompt], [tree])[0]  # fresh
        assert rows.shape == (len(tree[0]) + 1, VOCAB)
        torch.testing.assert_close(rows, chain_rows(m, prompt, tree), rtol=0, atol=tol)
        longer = prompt + [rng.randrange(VOCAB) for _ in range(40)]
        worker.score([name], [longer[:-3]], [1])  # cached, with 3 more uncached
        rows = worker.score_tree([name], [longer], [tree])[0]
        torch.testing.assert_close(rows, chain_rows(m, longer, tree), rtol=0, atol=tol)
        assert worker._caches.seqs[name].tree is not None and not worker._pool.row_of
        other = random_tree(rng, 2, 3)  # a tree right after a tree: the first is settled away
        rows = worker.score_tree([name], [longer + [tree[0][0]]], [other])[0]
        torch.testing.assert_close(rows, chain_rows(m, longer + [tree[0][0]], other), rtol=0, atol=tol)


@pytest.mark.parametrize("path,forward", [("pool", "lean"), ("pool", "transformers"), ("pool", "eager"),
                                          ("per-sequence", "lean")])
def test_batched_tree_rows_equal_chain_rows(model, eager, path, forward):
    """Ragged prefixes (cached or not), ragged trees (an empty one too), over rounds in which each
    sequence accepts a random path of its tree plus a few tokens: the next tree's rows are still
    the chain rows, and plain scores between trees too."""
    m = eager if forward == "eager" else model
    tol = EAGER_TOL if forward == "eager" else TOL
    worker = worker_for(m, path, lean=forward == "lean")
    rng = random.Random(1)
    ids = ["a", "b", "c", "d"]
    committed = dict(zip(ids, seqs(rng, 4)))
    worker.score(ids[:2], [committed[s][:-rng.randrange(1, 5)] for s in ids[:2]], [1, 1])  # cached prefixes
    for step in range(6):
        if step == 3:  # a long newcomer joins the running batch (the pool prefills most of it alone)
            ids.append("e")
            committed["e"] = seqs(rng, 1, 40, 41)[0]
        trees = [random_tree(rng, rng.randint(1, 3), rng.randint(1, 4)) for _ in ids]
        if step == 2:
            trees[1] = ([], [])  # no candidates: the root row alone
        got = worker.score_tree(ids, [committed[s] for s in ids], trees)
        for s, tree, rows in zip(ids, trees, got):
            torch.testing.assert_close(rows, chain_rows(m, committed[s], tree), rtol=0, atol=tol)
        if path == "pool":
            assert set(worker._pool.row_of) == set(ids) and not worker._caches.seqs
        for s, tree in zip(ids, trees):  # accept a random root-to-node path, then a few more tokens
            nodes = [i for i in range(len(tree[0])) if rng.random() < 0.6]
            node = rng.choice(nodes) if nodes else -1
            walk = []
            while node >= 0:
                walk.append(tree[0][node])
                node = tree[1][node]
            committed[s] += walk[::-1] + [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 3))]
        if step % 2:  # a plain score between trees settles them too
            nums = [rng.randint(1, 2) for _ in ids]
            got = worker.score(ids, [committed[s] for s in ids], nums)
            for s, n, rows in zip(ids, nums, got):
                torch.testing.assert_close(rows, _chain_last(m, committed[s], n), rtol=0, atol=tol)


def _chain_last(model, tokens, n):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -n:]


# -- (b) after the next call, the cache is the chain's --------------------------------------------

CASES = {
    # the path the next sequence takes through the tree below, and the tokens after it
    "all-rejected": ([], [5]),
    "full-leaf-path": ([1, 4, 6], []),  # node 6 is a leaf at depth 3
    "inner-node-path": ([1, 4], [8, 9]),  # stops at node 4, which has a child
    "third-root-child": ([2], [3]),  # a leaf, not first in node order: its column moves
    "diverges-in-the-prefix": None,
}
TREE = ([11, 12, 13, 14, 15, 16, 17], [-1, -1, -1, 0, 1, 1, 4])  # nodes 1 -> 4 -> 6 is depth 3


@pytest.mark.parametrize("path", ["solo", "pool", "per-sequence"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_cache_after_a_tree_is_the_chains(model, path, case):
    tree_worker, chain_worker = (Told(worker_for(model, path)) for _ in range(2))  # as the engine drives them
    rng = random.Random(2)
    ids = ["x"] if path == "solo" else ["x", "y", "z"]
    prefixes = seqs(rng, len(ids), 10, 20)
    for w in (tree_worker, chain_worker):
        w.score(ids, prefixes, [1] * len(ids))
    trees = [TREE] + [random_tree(rng, 2, 3) for _ in ids[1:]]
    tree_worker.score_tree(ids, prefixes, trees)
    nexts = []
    for b, (prefix, tree) in enumerate(zip(prefixes, trees)):
        if b == 0 and CASES[case] is None:
            nexts.append(prefix[:-4] + [1, 2, 3])
            continue
        nodes, extra = CASES[case] if b == 0 else (
            rng.choice(leaf_paths(tree[1]))[:rng.randint(0, 3)], [rng.randrange(VOCAB)])
        nexts.append(prefix + path_tokens(tree, nodes) + extra)
        if b == 0:
            assert accepted_path(*tree, nexts[-1], len(prefix)) == nodes
    nums = [1 + (b % 2) for b in range(len(ids))]
    a = tree_worker.score(ids, nexts, nums)
    c = chain_worker.score(ids, nexts, nums)
    for x, y, toks, n in zip(a, c, nexts, nums):
        torch.testing.assert_close(x, y, rtol=0, atol=TOL)
        torch.testing.assert_close(x, _chain_last(model, toks, n), rtol=0, atol=TOL)
    same_cache(tree_worker, chain_worker, ids)
    for _ in range(2):  # and on from there, the two stay the same
        nexts = [t + [rng.randrange(VOCAB) for _ in range(2)] for t in nexts]
        for x, y in zip(tree_worker.score(ids, nexts, [2] * len(ids)), chain_worker.score(ids, nexts, [2] * len(ids))):
            torch.testing.assert_close(x, y, rtol=0, atol=TOL)
    same_cache(tree_worker, chain_worker, ids)


def test_a_rejected_tree_gives_its_columns_back(model):
    """In the pool, the columns of the nodes a settled tree drops are free again: after a wholly
    rejected tree the pool is one column (the re-fed last prefix token) past the chain's."""
    worker, chain = worker_for(model, "pool"), worker_for(model, "pool")
    rng = random.Random(7)
    ids = ["p", "q"]
    prefixes = seqs(rng, 2, 6, 9)
    for w in (worker, chain):
        w.score(ids, prefixes, [1, 1])
    worker.score_tree(ids, prefixes, [([50, 51, 52, 53, 54], [-1, -1, 0, 1, 2])] * 2)
    assert worker._pool.used == chain._pool.used + 6
    nexts = [p + [3] for p in prefixes]
    for w in (worker, chain):
        w.score(ids, nexts, [1, 1])
    assert worker._pool.used == chain._pool.used + 1
    same_cache(worker, chain, ids)


def test_pending_trees_survive_compaction_and_idle_passes(model):
    """A row whose tree is pending while other rows run passes (idle, gathered subsets, a
    compaction of the pool) still settles to the chain's cache."""
    worker, chain = worker_for(model, "pool"), worker_for(model, "pool")
    rng = random.Random(3)
    ids = [f"s{i}" for i in range(6)]
    committed = dict(zip(ids, seqs(rng, 6, 8, 12)))
    for w in (worker, chain):
        w.score(ids, [committed[s] for s in ids], [1] * 6)
    tree = random_tree(rng, 3, 3)
    worker.score_tree(["s0"], [committed["s0"]], [tree])
    pool = worker._pool
    assert pool.row_of["s0"] in pool.trees
    rebuilds = []
    rebuild = pool._rebuild
    pool._rebuild = lambda *a: (rebuilds.append(pool.trees[pool.row_of["s0"]].start), rebuild(*a))
    for step in range(40):  # the others draft one token at a time, rejected every other step: holes
        group = ids[1:] if step % 3 else ids[1:2]  # all rows in the pass, or a gathered subset
        for s in group:
            committed[s].append(rng.randrange(VOCAB))
        for w in (worker, chain):
            w.score(group, [committed[s] for s in group], [1] * len(group))
        if step % 2:
            for s in group:
                committed[s].pop()
    assert rebuilds and pool.trees[pool.row_of["s0"]].start < rebuilds[0]  # compacted: its nodes moved along
    leaf = leaf_paths(tree[1])[-1]
    committed["s0"] += path_tokens(tree, leaf)
    for w in (worker, chain):
        got = w.score(ids, [committed[s] for s in ids], [1] * 6)
    torch.testing.assert_close(got[0], _chain_last(model, committed["s0"], 1), rtol=0, atol=TOL)
    same_cache(worker, chain, ids)


# -- (c) greedy through trees is plain greedy decoding ----------------------------------------------

def grow_tree(drafter: HFWorker, seq_ids, committed, widths):
    """Each sequence's tree from the drafter's top-k: ``widths[d]`` children per node at depth d,
    grown a level at a time with the drafter's own score_tree."""
    trees = [([], []) for _ in seq_ids]
    frontier = [[-1] for _ in seq_ids]
    for width in widths:
        rows = drafter.score_tree(seq_ids, committed, trees)
        new_frontier = []
        for b, (tokens, parents) in enumerate(trees):
            added = []
            for node in frontier[b]:
                for token in rows[b][node + 1].topk(width).indices.tolist():
                    tokens.append(token)
                    parents.append(node)
                    added.append(len(tokens) - 1)
            new_frontier.append(added)
        frontier = new_frontier
    return trees


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_along_tree_rows_is_plain_greedy(model, batch):
    drafter_model = make(seed=5, noise_from=model, noise=0.5)
    drafter, authority = HFWorker(drafter_model), HFWorker(model)
    rng = random.Random(4)
    ids = [f"g{i}" for i in range(batch)]
    prompts = seqs(rng, batch, 4, 12)
    committed = [list(p) for p in prompts]
    new_tokens, accepted_depths = 24, []
    while min(len(c) - len(p) for c, p in zip(committed, prompts)) < new_tokens:
        widths = [3, 2, 1, 1] if len(committed[0]) % 2 else [2, 2, 2]
        trees = grow_tree(drafter, ids, committed, widths)
        rows = authority.score_tree(ids, committed, trees)
        for b, ((tokens, parents), r) in enumerate(zip(trees, rows)):
            node, depth = -1, 0
            while True:  # follow the authority's argmax down the tree; the first miss is its own token
                best = int(r[node + 1].argmax())
                child = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == best), None)
                committed[b].append(best)
                if child is None:
                    break
                node, depth = child, depth + 1
            accepted_depths.append(depth)
    assert max(accepted_depths) >= 2 and min(accepted_depths) == 0  # long paths and misses both happened
    for prompt, out in zip(prompts, committed):
        plain = list(prompt)
        with torch.inference_mode():
            while len(plain) < len(out):
                plain.append(int(model(input_ids=torch.tensor([plain]), use_cache=False).logits[0, -1].argmax()))
        assert out == plain


# -- (d) the generic version, for any worker --------------------------------------------------------

class _PathByPathTable(TableWorker):
    score_tree = Worker.score_tree  # the generic version, not the table's own one-call override


def test_generic_score_tree_on_the_table_worker():
    worker = _PathByPathTable(vocab_size=6, seed=1)
    rng = random.Random(5)
    trees = [random_tree(rng, 3, 4, vocab=6), ([], []), ([2, 2, 5], [-1, -1, 1]), random_tree(rng, 2, 2, vocab=6)]
    prefixes = [[1, 3], [4], [0, 0, 5], [2]]
    worker.calls = 0
    got = worker.score_tree(["a", "b", "c", "d"], prefixes, trees)
    assert worker.calls == max(len(leaf_paths(t[1])) for t in trees)  # one call per leaf, batched
    for prefix, (tokens, parents), rows in zip(prefixes, trees, got):
        assert torch.equal(rows, worker.table[[prefix[-1]] + tokens])  # the bigram after each node
        for path in leaf_paths(parents):  # and the rows path scoring gives
            chain = worker.score(["p"], [prefix + [tokens[i] for i in path]], [len(path) + 1])[0]
            assert torch.equal(rows[[0] + [1 + i for i in path]], chain)
    assert all(torch.equal(a, b) for a, b in zip(TableWorker(vocab_size=6, seed=1).score_tree(
        ["a", "b", "c", "d"], prefixes, trees), got))  # the table's one-call override agrees
    sampling = Sampling(temperature=0.7, top_k=3)
    probs = worker.score_tree_probs(["a", "b"], prefixes[:2], trees[:2], sampling)
    for rows, p in zip(got[:2], probs):
        assert torch.equal(p, sampling.probs(rows))
    tensors = (torch.tensor(trees[0][0]), torch.tensor(trees[0][1]))
    assert torch.equal(worker.score_tree(["a"], prefixes[:1], [tensors])[0], got[0])
    named = SimpleNamespace(tokens=tensors[0], parents=tensors[1])  # e.g. the rule's DraftTree
    assert torch.equal(worker.score_tree(["a"], prefixes[:1], [named])[0], got[0])
    with pytest.raises(ValueError, match="parent"):
        worker.score_tree(["a"], [[1]], [([1, 2], [-1, 1])])
    with pytest.raises(ValueError, match="one entry per node: 2 tokens, 1 parents"):
        worker.score_tree(["a"], [[1]], [([1, 2], [-1])])


def test_models_without_a_one_pass_tree_score_path_by_path(model):
    """A model the worker cannot give a tree mask to (here: a subclass, whose forward may do
    anything) scores each root-to-leaf path as a chain, through its caches, with the same rows."""
    from transformers import LlamaForCausalLM

    class Custom(LlamaForCausalLM):
        pass

    custom = Custom(model.config).to(torch.float64).eval()
    custom.load_state_dict(model.state_dict())
    worker = HFWorker(custom)
    assert worker.lean is None and worker._tree_support() is None
    rng = random.Random(6)
    prefixes = seqs(rng, 2, 5, 10)
    trees = [random_tree(rng, 3, 3), random_tree(rng, 2, 4)]
    for rows, prefix, tree in zip(worker.score_tree(["a", "b"], prefixes, trees), prefixes, trees):
        torch.testing.assert_close(rows, chain_rows(model, prefix, tree), rtol=0, atol=TOL)
    nexts = [p + path_tokens(t, leaf_paths(t[1])[0]) for p, t in zip(prefixes, trees)]
    for rows, toks in zip(worker.score(["a", "b"], nexts, [2, 2]), nexts):
        torch.testing.assert_close(rows, _chain_last(model, toks, 2), rtol=0, atol=TOL)


# -- (e) a trimmed-vocabulary drafter ---------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2])
def test_trimmed_vocabulary_drafter_scores_trees(batch):
    """Authority ids in, authority-width rows out; two siblings outside the draft vocabulary are
    both OTHER to the model, and the path through the second one still settles right."""
    ids_ = [4, 1, 3]
    vocab = DraftVocab(ids_, 6)
    trimmed = make(seed=7, vocab=len(ids_) + 1)
    worker = Told(HFWorker(trimmed, draft_vocab=vocab))
    chain = Told(HFWorker(trimmed, draft_vocab=vocab))
    seq_ids = ["u", "v"][:batch]
    prefixes = [[4, 0, 1, 3, 2], [1, 1, 5]][:batch]
    tree = ([0, 2, 4, 1, 5, 3], [-1, -1, 0, 1, 1, 3])  # 0 and 2: OTHER; 1 -> 3 -> 5 runs below the second
    got = worker.score_tree(seq_ids, prefixes, [tree] * batch)
    for prefix, rows in zip(prefixes, got):
        assert rows.shape == (len(tree[0]) + 1, 6)
        for path in leaf_paths(tree[1]):
            want = chain.score(["c"], [prefix + path_tokens(tree, path)], [len(path) + 1])[0]
            torch.testing.assert_close(rows[[0] + [1 + i for i in path]], want, rtol=0, atol=TOL)
        assert torch.isinf(rows[:, [0, 2, 5]]).all()
    nexts = [p + [2, 1, 5, 4] for p in prefixes]  # down the second OTHER sibling, then off the tree
    assert accepted_path(vocab.to_draft(tree[0]), tree[1], vocab.to_draft(nexts[0]), len(prefixes[0])) == [1, 3]
    chain.release(["c"])
    for x, y in zip(worker.score(seq_ids, nexts, [2] * batch), chain.score(seq_ids, nexts, [2] * batch)):
        torch.testing.assert_close(x, y, rtol=0, atol=TOL)
    same_cache(worker, chain, seq_ids)
