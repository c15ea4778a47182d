"""`cascade record` -> `cascade distill --head` on a toy chat authority: the features are the
authority's own and cached resumably beside the records, training lowers the held-out loss and
resumes to the step, the drafting figures measure what the head worker drafts and what the
authority accepts, and the head loads as a topology level whose cascade gives exactly the
authority's greedy output."""
from __future__ import annotations

import json

import pytest
import torch

from cascade.cli import main
from conftest import TEXT, make_llama, write_topology
from head_util import distill_args
from hf_util import chat_tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("head-distill")
    tok = chat_tokenizer()
    authority = make_llama(root / "authority", len(tok), seed=1, hidden=32, layers=2, logit_scale=6.0, tokenizer=tok)
    (root / "code").mkdir()
    (root / "code" / "snippets.py").write_text(TEXT)
    assert main(["record", "--model", str(authority), "--out", str(root / "rec"), "--sequences", "12", "--batch", "4",
                 "--user-tokens", "8", "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32",
                 "--corpus", str(root / "code"), "--code-share", "0.5"]) == 0
    assert main(distill_args(root, root / "head", root / "work")) == 0
    return root, authority, tok


def load_authority(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_features_are_the_authoritys_and_resume_by_shard(trained):
    from cascade.train.head import cache_features

    root, authority, _ = trained
    feats = root / "rec" / "features"
    meta = json.loads((feats / "features.json").read_text())
    assert meta["model"] == str(authority) and meta["dtype"] == "float32" and len(meta["shards"]) == 3
    model = load_authority(authority)
    shard = torch.load(root / "rec" / "shard-00001.pt", weights_only=False)
    cached = torch.load(feats / "shard-00001.pt", weights_only=False)
    start = 0
    for n in shard["lengths"].tolist()[:2]:  # each conversation from position 0, as the authority saw it
        with torch.no_grad():
            want = model.model(shard["tokens"][None, start:start + n].long()).last_hidden_state[0]
        got = cached["features"][start:start + n]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.03, rtol=0.01)
        start += n
    # the LM head on the cached features gives the recorded top-1 (bf16 storage may flip a near-tie)
    n = shard["lengths"][0].item()
    top1 = (cached["features"][:n - 1].float() @ model.lm_head.weight.T).argmax(-1)
    assert (top1 == shard["topk_ids"][:n - 1, 0].long()).float().mean() > 0.95
    # killed mid-way: the missing shard alone is computed again, to the same features
    before = {p.name: p.stat().st_mtime_ns for p in feats.glob("shard-*.pt")}
    (feats / "shard-00001.pt").unlink()
    cache_features(root / "rec", feats, model, str(authority), log=lambda msg: None)
    after = {p.name: p.stat().st_mtime_ns for p in feats.glob("shard-*.pt")}
    assert after["shard-00000.pt"] == before["shard-00000.pt"] and after["shard-00002.pt"] == before["shard-00002.pt"]
    assert torch.equal(torch.load(feats / "shard-00001.pt", weights_only=False)["features"], cached["features"])
    with pytest.raises(SystemExit, match="remove it or give --features"):  # another model's cache is refused
        cache_features(root / "rec", feats, model, "another/model", log=lambda msg: None)
    # two processes computing into one folder: a shard the other wrote meanwhile is not computed
    # again, and features.json keeps both processes' entries
    kept = {n: (feats / n).read_bytes() for n in ("shard-00001.pt", "shard-00002.pt")}
    for n in kept:
        (feats / n).unlink()

    def other_process(msg):
        if "shard-00001.pt:" in msg:
            (feats / "shard-00002.pt").write_bytes(kept["shard-00002.pt"])
            meta = json.loads((feats / "features.json").read_text())
            meta["shards"]["shard-00002.pt"] = {"tokens": 1, "seconds": -1.0}
            (feats / "features.json").write_text(json.dumps(meta))

    cache_features(root / "rec", feats, model, str(authority), log=other_process)
    assert (feats / "shard-00002.pt").read_bytes() == kept["shard-00002.pt"]
    assert json.loads((feats / "features.json").read_text())["shards"]["shard-00002.pt"]["seconds"] == -1.0


def test_the_head_loads_and_training_lowered_the_held_out_loss(trained):
    from cascade.train.head import HeadObjective, HeadSampler, evaluate_head, load_head_data
    from workers.draft_vocab import DraftVocab
    from workers.head import FeatureHead, random_head

    root, authority, tok = trained
    out = root / "head"
    head = FeatureHead.from_pretrained(out)
    vocab = DraftVocab.load(out)
    assert head.lm_head is None and len(vocab.ids) == 64 and vocab.authority_vocab_size == len(tok)
    training = json.loads((out / "training.json").read_text())
    held = training["held_out"]
    assert held["positions"] > 0 and all(v == v for v in held.values())
    assert 0 <= held["top1_agreement"] <= 1 and 0 < held["expected_acceptance_t1"] <= 1
    drafting = training["drafting_greedy"]
    assert drafting["starts"] == 32 and drafting["depth"] == 3 and drafting["positions"] == "answers"
    assert drafting["accepted_at"] == sorted(drafting["accepted_at"], reverse=True)
    assert training["steps"] == 60 and training["lm_head"] == "authority"
    model = load_authority(authority)
    objective = HeadObjective(model.get_input_embeddings().weight, model.get_output_embeddings().weight, vocab.ids,
                              torch.device("cpu"))
    sampler = HeadSampler(load_head_data(root / "rec", root / "rec" / "features", held_out=True), 32, 4)
    untrained = random_head(model, seed=1, intermediate_size=model.config.intermediate_size).float()
    again = evaluate_head(head.float(), objective, sampler)
    assert again["loss"] == pytest.approx(held["loss"], rel=1e-5)
    assert again["loss"] < 0.9 * evaluate_head(untrained, objective, sampler)["loss"]


def test_training_resumes_to_the_step(trained, tmp_path):
    """Stopped after 25 steps and run again, the head is the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    root, _, _ = trained
    args = distill_args(root, tmp_path / "head", tmp_path / "work", "--eval-drafts", "0")
    assert main(args + ["--stop-after", "25"]) == 0
    assert (tmp_path / "work" / "checkpoint.pt").is_file() and not (tmp_path / "head").exists()
    assert main(args) == 0
    resumed, whole = load_file(tmp_path / "head" / "model.safetensors"), load_file(root / "head" / "model.safetensors")
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_a_head_continues_from_its_checkpoint(trained, tmp_path):
    """--init: training goes on from a saved head (its weights and its draft vocabulary), as the
    training stream does on each stretch of work; the held-out loss starts where it was."""
    from workers.draft_vocab import DraftVocab

    root, _, _ = trained
    args = [a for a in distill_args(root, tmp_path / "more", tmp_path / "work", "--eval-drafts", "0")
            if a not in ("--draft-vocab", "64")]
    assert main(args + ["--init", str(root / "head"), "--steps", "20"]) == 0
    first, more = (json.loads((d / "training.json").read_text()) for d in (root / "head", tmp_path / "more"))
    assert more["init"] == str(root / "head") and more["steps"] == 20
    assert torch.equal(DraftVocab.load(tmp_path / "more").ids, DraftVocab.load(root / "head").ids)
    assert more["held_out"]["loss"] < 1.1 * first["held_out"]["loss"]  # not a fresh start
    assert main(args + ["--init", str(root / "head"), "--draft-vocab", "64"]) == 2  # the vocabulary goes with it


def test_a_head_continues_on_token_ids_alone(trained, tmp_path):
    """--top-k 0 records (no scoring pass: what the training stream keeps) are enough for a head
    continued with --init: it computes its own targets from the authority's features. A drafter,
    or a draft vocabulary chosen from them, needs the top-k, and says so."""
    root, authority, _ = trained
    rec = ["record", "--model", str(authority), "--sequences", "12", "--batch", "4", "--user-tokens", "8",
           "--answer-tokens", "24", "--dtype", "float32", "--corpus", str(root / "code"), "--code-share", "0.5"]
    assert main(rec + ["--out", str(tmp_path / "ids"), "--top-k", "0"]) == 0
    shard = torch.load(tmp_path / "ids" / "shard-00001.pt", weights_only=False)
    assert "topk_ids" not in shard
    assert torch.equal(shard["tokens"], torch.load(root / "rec" / "shard-00001.pt", weights_only=False)["tokens"])
    with pytest.raises(SystemExit, match="top-8, not the top-0"):  # one folder, one kind of shard
        main(rec + ["--out", str(root / "rec"), "--top-k", "0"])
    args = [a for a in distill_args(root, tmp_path / "more", tmp_path / "work", "--eval-drafts", "0")
            if a not in ("--draft-vocab", "64")]
    args[args.index("--records") + 1] = str(tmp_path / "ids")
    assert main(args + ["--init", str(root / "head"), "--steps", "10"]) == 0
    assert json.loads((tmp_path / "more" / "training.json").read_text())["steps"] == 10
    args[args.index("--out") + 1] = str(tmp_path / "fresh")
    with pytest.raises(SystemExit, match="token ids alone"):
        main(args + ["--draft-vocab", "64"])


def first_held_out(trained):
    """The trained head, its authority and objective, and the first held-out conversation's
    tokens and features."""
    from cascade.train.head import HeadObjective, load_head_data
    from workers.draft_vocab import DraftVocab
    from workers.head import FeatureHead

    root, authority, _ = trained
    model = load_authority(authority)
    head = FeatureHead.from_pretrained(root / "head")
    vocab = DraftVocab.load(root / "head")
    objective = HeadObjective(model.get_input_embeddings().weight, model.get_output_embeddings().weight, vocab.ids,
                              torch.device("cpu"))
    held = load_head_data(root / "rec", root / "rec" / "features", held_out=True)
    start, length = next(held.conversations())
    return model, head, vocab, objective, held.tokens[start:start + length], held.features[start:start + length].float()


def test_the_drafting_figures_are_the_head_workers_drafts_and_the_authoritys_greedy(trained):
    """`_head_chains` drafts what HeadWorker drafts after the hand-off of the real features, and
    `_authority_logits` (one masked pass for every chain) gives what plain passes over each
    prefix give."""
    from cascade.train.head import _authority_logits, _head_chains
    from workers.head import HeadWorker

    model, head, vocab, objective, tokens, feats = first_held_out(trained)
    length = tokens.numel()
    chosen = torch.tensor([0, 3, length // 2, length - 2])
    with torch.no_grad():
        drafts, drafted = _head_chains(head, objective, tokens, feats, chosen, depth=3)
        assert torch.equal(drafted, torch.ones_like(drafted))  # greedy: drafted with certainty
        greedy = _authority_logits(model.model, objective, tokens, chosen, drafts, model).argmax(-1)
    worker = HeadWorker(head, model.get_input_embeddings(), model.get_output_embeddings(), draft_vocab=vocab)
    for i, p in enumerate(chosen.tolist()):
        seq, prefix = f"s{i}", tokens[:p + 1].tolist()
        worker.take_features([seq], [prefix], [0], [feats[:p]])
        chain = []
        for _ in range(3):
            row = worker._next_logits([seq], [prefix + chain])[0][-1]  # over the draft columns
            chain.append(int(worker.draft_columns[row.argmax()]))
        assert drafts[i].tolist() == chain
        with torch.no_grad():
            for j in range(3):
                logits = model(torch.tensor([prefix + chain[:j]])).logits[0, -1]
                assert int(greedy[i, j]) == int(logits.argmax())


def test_sampled_acceptance_estimates_the_overlap_of_draft_and_target(trained):
    """At T > 0 a drafted token counts min(1, target/draft): its mean over the head's own draws is
    the chance the engine's rule accepts, sum_x min(target(x), draft(x)) (checked at position 1)."""
    from cascade.train.head import _authority_logits, _head_chains

    model, head, vocab, objective, tokens, feats = first_held_out(trained)
    length = tokens.numel()
    chosen, t = torch.tensor([2, length // 2]), 0.8
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        target = torch.softmax(_authority_logits(model.model, objective, tokens, chosen,
                                                 torch.zeros(2, 1, dtype=torch.long), model)[:, 0] / t, -1)
        estimates = []
        for _ in range(400):
            drafts, drafted = _head_chains(head, objective, tokens, feats, chosen, 1, t, g)
            estimates.append((target.gather(-1, drafts)[:, 0] / drafted[:, 0]).clamp(max=1))
        row = objective.student_logits(head, head_outputs(head, objective, tokens, feats)[chosen]).float()
        draft = torch.zeros_like(target)
        draft[:, objective.to_authority(torch.arange(row.shape[-1]))] = torch.softmax(row / t, -1)
    exact = torch.minimum(target, draft).sum(-1)
    torch.testing.assert_close(torch.stack(estimates).mean(0), exact, atol=0.05, rtol=0)


def head_outputs(head, objective, tokens, feats):
    import torch.nn.functional as F

    from workers.head import shifted

    n = tokens.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    return head(shifted(feats[None]), F.embedding(tokens, objective.embed)[None], torch.arange(n)[None], causal)[0]


def test_a_distilled_head_under_its_authority_is_exact_greedy(trained, tmp_path):
    from cascade import Cascade

    root, authority, tok = trained
    topo = write_topology(tmp_path / "t.yaml", {
        "levels": [{"name": "head", "kind": "head", "model": str(root / "head"), "features_of": "authority"},
                   {"name": "authority", "model": str(authority), "dtype": "float32"}],
        "policy": {"name": "fixed", "params": {"lookahead": {"head": 3}}},
        "sampling": {"temperature": 0.0}})
    prompt = tok.apply_chat_template([{"role": "user", "content": "def fibonacci(n):"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    model = load_authority(authority)
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    with Cascade.from_topology(topo) as c:
        g = c.generate(ids, max_new_tokens=40)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert g.token_ids == want[:len(g.token_ids)] and (len(g.token_ids) == 40 or g.token_ids[-1] == eos)
    assert g.stats.edges["head->authority"].proposed > 0


def test_drafting_figures_of_a_head_that_recomputes_its_authority(tmp_path, tokenizer):
    """A positive control: a head that is its 1-layer authority's own layer (tests/head_util.py)
    drafts the authority's greedy tokens at every depth; a random head does not."""
    from cascade.train.head import HeadData, HeadObjective, conversation_features, draft_acceptance
    from head_util import copy_head
    from hf_util import prompts_from_text
    from workers.head import random_head

    auth = make_llama(tmp_path / "auth", len(tokenizer), seed=1, hidden=32, layers=1, logit_scale=30.0,
                      dtype=torch.float64, tokenizer=tokenizer)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(auth, dtype=torch.float64).eval()
    convs = [p for p in prompts_from_text(tokenizer, 6) if len(p) >= 6]
    lengths = [len(p) for p in convs]
    tokens = torch.tensor([t for p in convs for t in p])
    conv = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.cat([torch.arange(n) for n in lengths])
    data = HeadData(tokens, conversation_features(model, tokens, lengths), position, conv, lengths)
    objective = HeadObjective(model.get_input_embeddings().weight, model.get_output_embeddings().weight, None,
                              torch.device("cpu"))
    exact = draft_acceptance(copy_head(auth, noise=0.0, feature_weight=0.0), objective, model, data, starts=40)
    assert exact["starts"] == 40 and exact["accepted_at"] == [1.0, 1.0, 1.0]
    assert exact["tokens_per_authority_pass"] == 4.0 and exact["positions"] == "all"
    # answers starting 3 tokens before each end: the starts draft from the last 3 positions but one
    tail = draft_acceptance(copy_head(auth, noise=0.0, feature_weight=0.0), objective, model, data, starts=40,
                            answers=[n - 3 for n in lengths])
    assert tail["starts"] == 3 * len(lengths) and tail["positions"] == "answers"
    other = draft_acceptance(random_head(model, seed=3).double(), objective, model, data, starts=40)
    assert other["accepted_at"][0] < 0.5 and other["tokens_per_authority_pass"] < 2.0


def test_drafting_figures_start_in_the_answers():
    """The drafting figures draft what the engine drafts: the answers, found after the chat
    template's generation prompt; the system prompt and the user's turn are left out."""
    from cascade.train.head import HeadData, answer_starts, generation_prompt

    tokenizer = chat_tokenizer()
    marker = generation_prompt(tokenizer)
    assert tokenizer.decode(marker) == "<|im_start|>assistant\n"
    chats = []
    for q, a in (("hi", "hello there, how can I help"), ("2+2?", "4, of course")):
        opened = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                               add_generation_prompt=True)
        opened = list(opened["input_ids"] if hasattr(opened, "keys") else opened)
        chats.append((opened, tokenizer(a, add_special_tokens=False).input_ids))
    lengths = [len(o) + len(a) for o, a in chats]
    tokens = torch.tensor([t for o, a in chats for t in o + a])
    data = HeadData(tokens, torch.zeros(len(tokens), 4), torch.zeros(len(tokens)), torch.zeros(len(tokens)), lengths)
    assert answer_starts(data, marker) == [len(o) for o, _ in chats]
    assert answer_starts(data, [10**6]) == [None, None]
    assert generation_prompt(object()) is None  # no chat template: every position counts
