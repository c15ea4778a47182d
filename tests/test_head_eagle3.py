"""EAGLE-3's options for feature heads (workers/head.py, cascade/train/head_eagle3.py).

Fused features: the authority's worker keeps the inputs of the head's chosen decoder layers from
the passes it runs anyway (lean forward and transformers' alike, on every cache path); a fused
head drafts from them as a naive recomputation does, its hand-off needs no extra pass, its
cascade's greedy output is the authority's token for token, and its sampled output follows the
authority's distribution (100k draws, with a negative control). Training: ``cascade distill
--head --fuse-layers ... --ttt-steps 3`` caches the layers' features (recomputed for other
layers), resumes to the step, and the training-time test lowers the held-out loss of the third
drafted token.
"""
from __future__ import annotations

import json

import pytest
import torch

from cascade import Cascade
from cascade.cli import main
from conftest import make_llama, write_topology
from head_util import (VOCAB, check, copy_head, distill_args, draw, entries, exact_pairs, hand_features,
                       misreport_head_probs)
from hf_util import chat_tokenizer, prompts_from_text, reference_greedy
from stats_util import chi_square_pvalue
from workers.head import FeatureHead, HeadConfig, HeadWorker, random_head
from workers.hf import HFWorker

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """A 3-layer float64 authority and random heads over its layers 0 and 2 (a plain one, and
    one with grouped-query attention)."""
    root = tmp_path_factory.mktemp("eagle3")
    auth = make_llama(root / "auth", len(tokenizer), seed=1, hidden=32, layers=3, logit_scale=30.0,
                      dtype=torch.float64, tokenizer=tokenizer)
    random_head(auth, seed=3, fuse_layers=LAYERS).save_pretrained(root / "fused")
    random_head(auth, seed=7, num_attention_heads=4, num_key_value_heads=2, fuse_layers=LAYERS,
                scale=0.3).save_pretrained(root / "fused-gqa")
    return root


def fused_features(model, tokens, layers=LAYERS) -> torch.Tensor:
    """A fresh full pass: the inputs of ``layers`` at every position, side by side."""
    with torch.no_grad():
        states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([states[k][0] for k in layers], dim=-1)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
@pytest.mark.parametrize("cache", ["solo", "pool", "per-sequence"])
def test_kept_fused_features_follow_the_cache(models, lean, cache):
    """As tests/test_head.py's test for the last hidden state: after chains partly rejected and
    trees settled, the fused features kept of a sequence are a fresh pass's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models / "auth", dtype=torch.float64)
    worker = HFWorker(model, device="cpu", lean=lean)
    assert (worker.lean is not None) == lean
    worker.keep_features(LAYERS)
    if cache == "per-sequence":
        worker._pool = None  # no pool: every sequence in its own cache
    ids = ["a", "b"] if cache != "solo" else ["a"]
    seqs = [[5, 17, 30, 2, 99, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15]][:len(ids)]

    def check_kept(sequences):
        for s, seq in zip(ids, sequences):
            kept = worker._features.read(s, seq, 0)
            assert kept is not None and kept.shape[1] == 32 * len(LAYERS)
            torch.testing.assert_close(kept, fused_features(model, seq)[:-1], rtol=0, atol=1e-10)

    worker.score(ids, [s + b for s, b in zip(seqs, [[1, 2, 3], [4, 5, 6]])], [4] * len(ids))
    seqs = [s + t for s, t in zip(seqs, [[1, 77], [4, 5, 6, 88]])]
    check_kept(seqs)
    worker.score_tree(ids, seqs, [([20, 21, 22, 23], [-1, -1, 0, 2]), ([30, 31, 32], [-1, 0, 0])][:len(ids)])
    seqs = [s + t for s, t in zip(seqs, [[21, 50], [30, 32, 60]])]
    check_kept(seqs)
    worker.release(ids)
    assert worker._features.seqs == {}


def naive_logits(worker: HeadWorker, tokens, real, first):
    """The head's logits after ``tokens[:t + 1]`` for ``t >= first``, recomputed without a cache:
    position t takes the projected real feature of t - 1 where ``real`` has it, else the head's
    own prediction (zeros at 0)."""
    head, predicted, out = worker.head, [], []
    with torch.no_grad():
        for t in range(len(tokens)):
            feats = [torch.zeros(head.config.hidden_size, dtype=real.dtype)]
            for s in range(1, t + 1):
                feats.append(head.project(real[s - 1]) if s - 1 < real.shape[0] else predicted[s - 1])
            f_hat = head(torch.stack(feats)[None], worker.embed(torch.tensor([tokens[:t + 1]])))[0, -1]
            predicted.append(f_hat)
            if t >= first:
                out.append(worker.lm_head(f_hat))
    return out


@pytest.mark.parametrize("kind", ["fused", "fused-gqa"])
def test_a_fused_head_drafts_as_a_naive_recomputation_with_no_extra_pass(models, kind):
    from cascade.sampling import Sampling

    source = HFWorker(str(models / "auth"), dtype="float64", device="cpu")
    head = HeadWorker.load(models / kind, source, "auth")
    assert source._features.layers == LAYERS
    passes = []
    original = source.score
    source.score = lambda *a: passes.append(a[1]) or original(*a)
    prompt = [5, 17, 30, 2, 99, 41]
    gen = torch.Generator().manual_seed(0)
    assert hand_features(head, source, ["a"], [prompt]) == [0] and len(passes) == 1  # the prefill
    draft = head.draft(["a"], [prompt], [4], Sampling(temperature=1.0),
                       [torch.rand(4, generator=gen, dtype=torch.float64)])[0]
    want = naive_logits(head, prompt + draft.tokens[:-1], fused_features(source.model, prompt)[:-1], len(prompt) - 1)
    for row, logits in zip(draft.probs, want):
        torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)
    # the authority verifies, keeps two and replaces the third: the hand-off needs no pass
    block = draft.tokens
    source.score(["a"], [prompt + block], [len(block) + 1])
    seq = prompt + block[:2] + [(block[2] + 1) % source.vocab_size]
    passes.clear()
    hand_features(head, source, ["a"], [seq])
    assert passes == []
    tokens, real = entries(head, "a")
    assert real == len(tokens) and tokens == seq[:real]
    again = head.draft(["a"], [seq], [2], Sampling(temperature=1.0), [torch.tensor([0.3, 0.6], dtype=torch.float64)])[0]
    want = naive_logits(head, seq + again.tokens[:-1], fused_features(source.model, seq)[:-1], len(seq) - 1)
    for row, logits in zip(again.probs, want):
        torch.testing.assert_close(row, torch.softmax(logits, -1), rtol=0, atol=1e-12)


def test_fused_heads_bad_input(models, tmp_path):
    source = HFWorker(str(models / "auth"), dtype="float64", device="cpu")
    with pytest.raises(ValueError, match="distinct decoder layers in 0..2"):
        source.keep_features([0, 3])
    head = HeadWorker.load(models / "fused", source, "auth")
    with pytest.raises(ValueError, match="read the same features"):
        source.keep_features(None)  # a head over the last hidden state beside a fused one
    with pytest.raises(ValueError, match="features of width 32; this head reads 64"):
        head.take_features(["s"], [[1, 2, 3]], [0], [torch.zeros(2, 32, dtype=torch.float64)])
    for bad in ([], [1, 1], [-1], "2"):
        with pytest.raises(ValueError, match="fuse_layers"):
            HeadConfig(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=2,
                       vocab_size=8, fuse_layers=bad)
    # a head over the last hidden state writes the config it always did
    random_head(models / "auth", seed=1).save_pretrained(tmp_path / "plain")
    assert "fuse_layers" not in json.loads((tmp_path / "plain" / "head_config.json").read_text())
    again = FeatureHead.from_pretrained(models / "fused")
    assert again.config.fuse_layers == LAYERS and again.fuse.weight.shape == (32, 64)


def topology(models, tmp_path, head: str, tree=None, name="t.yaml"):
    levels = [{"name": "head", "kind": "head", "model": str(models / head), "features_of": "auth"},
              {"name": "auth", "model": str(models / "auth"), "dtype": "float64", "device": "cpu"}]
    params = {"lookahead": {"head": 4}, **({"tree": {"head": tree}} if tree else {})}
    return write_topology(tmp_path / name, {"levels": levels, "policy": {"name": "fixed", "params": params}})


@pytest.mark.parametrize("tree", [None, [2, 2, 1]], ids=["chain", "tree"])
def test_greedy_identity_with_a_fused_head(models, tmp_path, tokenizer, tree):
    prompts = prompts_from_text(tokenizer, 3)
    with Cascade.from_topology(topology(models, tmp_path, "fused-gqa", tree)) as c:
        solo = [c.generate(p, max_new_tokens=24, temperature=0.0) for p in prompts]
        batched = c.generate(prompts, max_new_tokens=24, temperature=0.0, batch_size=3)  # the pool
    for p, g, b in zip(prompts, solo, batched):
        want = reference_greedy(models / "auth", p, 24)
        assert g.token_ids == want and b.token_ids == want
    assert solo[0].stats.edges["head->auth"].proposed > 0


# -- exactness under sampling ------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """tests/test_head_distribution.py's authority (8 tokens, one layer) and a copy head that
    reads its layer 0's input fused (projected by a random map) instead of its last hidden state,
    with its own output head (the authority's, sharpened: a flat head would misreport its
    ``draft_probs`` as uniform without consequence, and the negative control would test nothing)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("eagle3-dist")
    auth = make_llama(root / "auth", VOCAB, seed=31, hidden=8, layers=1, logit_scale=15.0, dtype=torch.float64)
    plain = copy_head(auth, noise=0.2, seed=32, feature_weight=0.3)
    config = HeadConfig(**{**plain.config.__dict__, "fuse_layers": [0], "lm_head_rows": VOCAB})
    head = FeatureHead(config).to(torch.float64)
    head.load_state_dict(plain.state_dict(), strict=False)
    lm_head = AutoModelForCausalLM.from_pretrained(auth, dtype=torch.float64).lm_head.weight
    with torch.no_grad():
        head.fuse.weight.copy_(30 * torch.randn(8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
        head.lm_head.weight.copy_(5 * lm_head)
    head.save_pretrained(root / "head")
    return root


def dist_topology(root) -> str:
    levels = [{"name": "head", "kind": "head", "model": str(root / "head"), "features_of": "auth"},
              {"name": "auth", "model": str(root / "auth"), "dtype": "float64", "device": "cpu"}]
    data = {"levels": levels, "policy": {"name": "fixed", "params": {"lookahead": {"head": 3}}}}
    return str(write_topology(root / "head-auth.yaml", data))


def test_a_fused_head_then_authority_is_exact(dist):
    """100k draws of the first two tokens through the engine against the authority's own
    distribution by enumeration (tests/test_head_distribution.py's method)."""
    n = 100_000
    counts, proposed, accepted, _ = draw(dist_topology(dist), n, seed=11)
    assert 0.2 < accepted / proposed < 0.9
    check(counts, exact_pairs(dist / "auth"), n, 0.014)


def test_a_fused_head_misreporting_its_draft_probs_fails(dist, monkeypatch):
    """The negative control: uniform ``draft_probs`` reported for what the fused head sampled."""
    misreport_head_probs(monkeypatch)
    n = 20_000
    counts, _, _, _ = draw(dist_topology(dist), n, seed=12)
    _, pvalue = chi_square_pvalue(counts, exact_pairs(dist / "auth"), n)
    assert pvalue < 1e-9


# -- training ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """tests/test_distill_head.py's recording, with a 4-layer chat authority."""
    from conftest import TEXT

    root = tmp_path_factory.mktemp("eagle3-distill")
    tok = chat_tokenizer()
    authority = make_llama(root / "authority", len(tok), seed=1, hidden=32, layers=4, logit_scale=6.0, tokenizer=tok)
    (root / "code").mkdir()
    (root / "code" / "snippets.py").write_text(TEXT)
    assert main(["record", "--model", str(authority), "--out", str(root / "rec"), "--sequences", "12", "--batch", "4",
                 "--user-tokens", "8", "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32",
                 "--corpus", str(root / "code"), "--code-share", "0.5"]) == 0
    return root, authority, tok


def train(root, name, *extra):
    args = distill_args(root, root / name, root / f"work-{name}", "--features", str(root / f"feats-{name}"), *extra)
    assert main(args) == 0
    return json.loads((root / name / "training.json").read_text())


def test_a_fused_head_trains_caches_its_layers_and_runs_exactly(recorded, tmp_path):
    root, authority, tok = recorded
    training = train(root, "fused", "--fuse-layers", "auto", "--ttt-steps", "3")
    assert training["fuse_layers"] == [1, 2] and training["ttt_steps"] == 3 and training["reg_weight"] == 0.0
    assert training["drafting_greedy"]["starts"] == 32 and len(training["held_out"]["kl_by_draft_step"]) == 3
    meta = json.loads((root / "feats-fused" / "features.json").read_text())
    assert meta["layers"] == [1, 2] and all(s["layers"] == [1, 2] for s in meta["shards"].values())
    shard = torch.load(root / "feats-fused" / "shard-00000.pt", weights_only=False)
    model = HFWorker(str(authority), dtype="float32", device="cpu").model
    n = shard["lengths"][0].item()
    want = fused_features(model, shard["tokens"][:n].tolist(), [1, 2])
    torch.testing.assert_close(shard["fused"][:n].float(), want, atol=0.03, rtol=0.01)
    # the cache of other layers is computed again, not read
    from cascade.train.head import cache_features, load_head_data

    with pytest.raises(SystemExit, match="compute them again"):
        load_head_data(root / "rec", root / "feats-fused", held_out=False, layers=[0, 3])
    cache_features(root / "rec", root / "feats-fused", model, str(authority), log=lambda m: None, layers=[0, 3])
    assert load_head_data(root / "rec", root / "feats-fused", held_out=False, layers=[0, 3]).fused.shape[1] == 64
    # as a topology level: its cascade gives the authority's greedy output, token for token
    levels = [{"name": "head", "kind": "head", "model": str(root / "fused"), "features_of": "auth"},
              {"name": "auth", "model": str(authority), "dtype": "float32", "device": "cpu"}]
    topo = write_topology(tmp_path / "t.yaml", {"levels": levels, "policy": {
        "name": "fixed", "params": {"lookahead": {"head": 3}}}})
    prompts = prompts_from_text(tok, 3)
    with Cascade.from_topology(topo) as c:
        assert c.workers["auth"]._features.layers == [1, 2]
        got = c.generate(prompts, max_new_tokens=20, temperature=0.0, batch_size=3)
    for p, g in zip(prompts, got):
        assert g.token_ids == reference_greedy(authority, p, 20)


def test_the_training_time_test_lowers_the_third_drafts_loss_and_resumes(recorded):
    """Same records, same steps: unrolled three steps, the head's held-out KL at its third
    drafted token is lower than trained on real features alone; stopped and resumed, the run
    ends with the uninterrupted run's head, bit for bit."""
    from safetensors.torch import load_file

    root, _, _ = recorded
    flags = ("--fuse-layers", "1,3", "--eval-drafts", "0", "--steps", "120")
    plain = train(root, "fused-plain", *flags)
    ttt = train(root, "fused-ttt", *flags, "--ttt-steps", "3")
    assert ttt["held_out"]["kl_by_draft_step"][2] < plain["held_out"]["kl_by_draft_step"][2]
    args = distill_args(root, root / "resumed", root / "work-resumed", "--features", str(root / "feats-fused-ttt"),
                        *flags, "--ttt-steps", "3")
    assert main(args + ["--stop-after", "50"]) == 0 and not (root / "resumed").exists()
    assert main(args) == 0
    resumed, whole = load_file(root / "resumed" / "model.safetensors"), load_file(root / "fused-ttt" / "model.safetensors")
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_plain_head_continued_fused_starts_where_it_was(models):
    """``fused_from``: where the last hidden state is a linear map of the fused inputs, the fitted
    fuse map recovers it and the continued head predicts what the plain head did; a head that
    already fuses, or data without fused inputs, is refused."""
    from cascade.train.head import HeadData
    from cascade.train.head_eagle3 import fit_fuse, fused_from

    plain = random_head(models / "auth", seed=5).double()
    torch.manual_seed(0)
    fused_in = torch.randn(600, 64, dtype=torch.float64)
    features = fused_in @ torch.randn(64, 32, dtype=torch.float64) / 8
    weight, stats = fit_fuse(fused_in, features, ridge=1e-12)
    assert stats["rel_err_held"] < 1e-6 and stats["r2_fit"] > 1 - 1e-9
    torch.testing.assert_close(fused_in @ weight.double().T, features, atol=1e-4, rtol=1e-4)
    data = HeadData(torch.zeros(600, dtype=torch.long), features, torch.arange(600), torch.zeros(600, dtype=torch.long),
                    [600], fused_in)
    head, stats = fused_from(plain, LAYERS, data)
    assert head.config.fuse_layers == LAYERS and stats["r2_held"] > 0.999
    embeds = torch.randn(1, 10, 32, dtype=torch.float64)
    with torch.no_grad():
        want = plain(plain.project(features[None, :10]), embeds)
        got = head(head.project(fused_in[None, :10]), embeds)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="already fuses"):
        fused_from(head, LAYERS, data)
    with pytest.raises(ValueError, match="no fused inputs"):
        fused_from(plain, LAYERS, HeadData(data.tokens, features, data.position, data.conv, [600]))


def test_distill_continues_a_plain_head_with_fused_features(recorded):
    """``--init PLAIN --fuse-layers``: the plain head's weights, a fitted fuse map, its figures in
    training.json; a fused --init with other layers is still refused."""
    root, _, _ = recorded
    train(root, "plain-init", "--eval-drafts", "0", "--steps", "20")

    def continued(name, *extra):  # a continued head keeps its draft vocabulary: no --draft-vocab
        args = distill_args(root, root / name, root / f"work-{name}", "--features", str(root / f"feats-{name}"),
                            "--init", str(root / "plain-init"), "--eval-drafts", "0", "--steps", "10", *extra)
        at = args.index("--draft-vocab")
        return args[:at] + args[at + 2:]

    assert main(continued("fused-cont", "--fuse-layers", "1,3", "--reg-weight", "1")) == 0
    training = json.loads((root / "fused-cont" / "training.json").read_text())
    assert training["fuse_layers"] == [1, 3] and training["reg_weight"] == 1.0
    assert set(training["fuse_fit"]) == {"rel_err_held", "r2_held", "rel_err_fit", "r2_fit"}
    assert HeadConfig.load(root / "fused-cont").fuse_layers == [1, 3]
    args = continued("refused", "--fuse-layers", "1,2")
    args[args.index(str(root / "plain-init"))] = str(root / "fused-cont")
    with pytest.raises(SystemExit, match="the --init head reads"):
        main(args)
