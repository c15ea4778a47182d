"""`cascade record` -> `cascade distill --records` on a toy chat authority: the records hold the
authority's own top-k, the distilled drafter has a trimmed vocabulary, loads as a level, and the
cascade's greedy output equals plain greedy decoding of the authority."""
from __future__ import annotations

import json

import pytest
import torch

from cascade.cli import main
from cascade.train.records import RecordBatch, record_loss
from conftest import TEXT, make_llama, write_topology
from hf_util import chat_tokenizer

@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    root = tmp_path_factory.mktemp("records")
    tok = chat_tokenizer()
    authority = make_llama(root / "authority", len(tok), seed=1, hidden=32, layers=2, logit_scale=6.0, tokenizer=tok)
    code = root / "code"
    code.mkdir()
    (code / "snippets.py").write_text(TEXT)
    args = ["record", "--model", str(authority), "--out", str(root / "rec"), "--sequences", "24", "--batch", "4",
            "--user-tokens", "8", "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32",
            "--corpus", str(code), "--code-share", "0.5"]
    assert main(args) == 0
    return root, authority, tok


def test_records_hold_the_authoritys_own_top_k(recorded):
    from transformers import AutoModelForCausalLM

    root, authority, tok = recorded
    meta = json.loads((root / "rec" / "record.json").read_text())
    assert len(meta["shards"]) == 6 and meta["top_k"] == 8
    shard = torch.load(root / "rec" / "shard-00001.pt", weights_only=False)
    lengths = shard["lengths"].tolist()
    assert shard["tokens"].numel() == sum(lengths)
    assert shard["topk_ids"].shape == (sum(lengths) - len(lengths), 8)
    text = tok.decode(shard["tokens"][:lengths[0]].tolist())
    assert text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in text
    model = AutoModelForCausalLM.from_pretrained(authority, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(shard["tokens"][None, :lengths[0] - 1].long()).logits[0]
    top = torch.log_softmax(logits, -1).topk(8, -1)
    assert torch.equal(shard["topk_ids"][:lengths[0] - 1].long(), top.indices)
    torch.testing.assert_close(shard["topk_logprobs"][:lengths[0] - 1].float(), top.values, atol=2e-3, rtol=0)
    again = root / "rec-again"  # a pure function of the seed: a resumed run writes the same shards
    assert main(["record", "--model", str(authority), "--out", str(again), "--sequences", "8", "--batch", "4",
                 "--user-tokens", "8", "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32",
                 "--corpus", str(root / "code"), "--code-share", "0.5"]) == 0
    assert torch.equal(torch.load(again / "shard-00001.pt", weights_only=False)["tokens"], shard["tokens"])


def test_grouped_shards_equal_shards_one_at_a_time_and_resume(recorded, tmp_path):
    """--group: shards generated together (the batch's places shared across them) are the shards
    generated one at a time, token for token; a resumed run fills in only the missing ones."""
    root, authority, tok = recorded
    common = ["record", "--model", str(authority), "--sequences", "24", "--batch", "4", "--user-tokens", "8",
              "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32", "--corpus", str(root / "code"),
              "--code-share", "0.5", "--out", str(tmp_path / "one")]
    assert main(common + ["--group", "1"]) == 0
    names = [f"shard-{i:05d}.pt" for i in range(6)]

    def same(name):
        a, b = (torch.load(d / name, weights_only=False) for d in (root / "rec", tmp_path / "one"))
        return (torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["lengths"], b["lengths"])
                and a["kinds"] == b["kinds"] and a["temperature"] == b["temperature"])

    assert all(same(name) for name in names)  # the fixture's shards: --group 3 (the default)
    for name in names[2::2]:
        (tmp_path / "one" / name).unlink()
    written = {n: (tmp_path / "one" / n).stat().st_mtime_ns for n in names[1::2]}
    assert main(common + ["--group", "4"]) == 0
    assert all(same(name) for name in names)
    assert written == {n: (tmp_path / "one" / n).stat().st_mtime_ns for n in names[1::2]}  # not written again
    assert len(json.loads((tmp_path / "one" / "record.json").read_text())["shards"]) == 6
    with pytest.raises(SystemExit, match="--group"):
        main(common + ["--group", "0"])


def test_distilled_trimmed_drafter_loads_and_keeps_greedy_identity(recorded, tmp_path):
    from transformers import AutoModelForCausalLM

    from cascade import Cascade
    from cascade.topology import load_topology

    root, authority, tok = recorded
    out = tmp_path / "drafter"
    args = ["distill", "--records", str(root / "rec"), "--draft-vocab", "64", "--size", "1x32", "--out", str(out),
            "--steps", "20", "--seq-len", "32", "--batch-size", "4", "--work-dir", str(tmp_path / "work"),
            "--no-progress", "--threads", "1", "--amp", "none", "--save-dtype", "float32"]
    assert main(args) == 0
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert len(vocab["ids"]) == 64 and vocab["authority_vocab_size"] == len(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in vocab["ids"]  # special tokens always kept
    training = json.loads((out / "training.json").read_text())
    assert 0 < training["draft_vocab_coverage"] <= 1 and training["held_out"]["positions"] > 0
    assert all(v == v for v in training["held_out"].values())  # finite, not NaN
    topo = write_topology(tmp_path / "t.yaml", {
        "levels": [{"name": "ngram", "kind": "ngram"}, {"name": "draft", "model": str(out)},
                   {"name": "authority", "model": str(authority)}],
        "edges": [["ngram", "draft"], ["draft", "authority"], ["ngram", "authority"]],
        "policy": {"name": "fixed", "params": {"lookahead": {"draft": 4}}},
        "sampling": {"temperature": 0.0}})
    load_topology(topo)  # validate: one tokenizer, the drafter's declared authority vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # shipped without them
        (out / name).unlink(missing_ok=True)
    load_topology(topo)  # draft_vocab.json says its ids are the authority's
    prompt = tok.apply_chat_template([{"role": "user", "content": "def fibonacci(n):"}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(authority, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
    with Cascade.from_topology(topo) as c:
        g = c.generate(ids, max_new_tokens=40)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert g.token_ids == want[:len(g.token_ids)] and (len(g.token_ids) == 40 or g.token_ids[-1] == eos)
    assert g.stats.edges["draft->authority"].proposed > 0


def test_record_loss_is_the_kl_on_the_recorded_partition():
    """Zero where the student equals the teacher on {top-k tokens, the rest}; positive otherwise;
    positions without a teacher row do not count."""
    teacher = torch.tensor([0.5, 0.3, 0.2, 0.0])  # over draft ids 0..2 and OTHER (never predicted)
    ids = torch.tensor([[[0, 1, -1]]])  # id 2 is in the rest: outside the recorded top-k
    logp = torch.log(torch.tensor([[[0.5, 0.3, 1.0]]]))
    batch = RecordBatch(torch.zeros(1, 1, dtype=torch.long), ids, logp, torch.tensor([[True]]))
    same = torch.log(teacher.clamp(min=1e-30))[None, None]
    kl, top1 = record_loss(same, batch)
    assert abs(kl.item()) < 1e-6 and top1.item() == 1.0
    rest_moved = torch.log(torch.tensor([0.5, 0.25, 0.25, 1e-9]))[None, None]  # rest mass 0.25 vs 0.2
    assert record_loss(rest_moved, batch)[0].item() > 1e-3
    batch.has_row[:] = False
    assert torch.isnan(record_loss(rest_moved, batch)[0])  # no rows: nothing to average (never sampled)


def test_first_records_only_the_later_shards_and_they_are_the_same(recorded, tmp_path):
    """--first: a second recorder takes the shards from an index on, and writes what one recorder
    would have written there (a shard is a function of its index), so two can extend one --keep."""
    root, authority, tok = recorded
    common = ["record", "--model", str(authority), "--sequences", "24", "--batch", "4", "--user-tokens", "8",
              "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32", "--corpus", str(root / "code"),
              "--code-share", "0.5", "--out", str(tmp_path / "late"), "--keep", str(tmp_path / "kept")]
    assert main(common + ["--first", "4"]) == 0
    assert sorted(p.name for p in (tmp_path / "late").glob("shard-*.pt")) == ["shard-00004.pt", "shard-00005.pt"]
    assert sorted(p.name for p in (tmp_path / "kept").glob("shard-*")) == ["shard-00004.npz", "shard-00005.npz"]
    for name in ("shard-00004.pt", "shard-00005.pt"):
        a, b = (torch.load(d / name, weights_only=False) for d in (root / "rec", tmp_path / "late"))
        assert torch.equal(a["tokens"], b["tokens"]) and a["kinds"] == b["kinds"]
    with pytest.raises(SystemExit, match="--first"):
        main(common + ["--first", "-1"])


def test_kept_ids_are_scored_not_generated_again(recorded, tmp_path):
    """--keep: each shard's token ids, compressed; a shard found there is only scored, so a
    recording carried in a repository is rebuilt on a machine whose cache is gone."""
    root, authority, tok = recorded
    common = ["record", "--model", str(authority), "--sequences", "8", "--batch", "4", "--user-tokens", "8",
              "--answer-tokens", "24", "--top-k", "8", "--dtype", "float32", "--corpus", str(root / "code"),
              "--code-share", "0.5", "--keep", str(tmp_path / "kept")]
    assert main(common + ["--out", str(tmp_path / "first")]) == 0
    kept = sorted((tmp_path / "kept").glob("shard-*.npz"))
    assert [p.name for p in kept] == ["shard-00000.npz", "shard-00001.npz"]
    first = torch.load(tmp_path / "first" / "shard-00001.pt", weights_only=False)
    assert kept[1].stat().st_size < first["tokens"].numel() * 2 + 1024  # under 2 bytes a token
    # a machine with only the kept ids: nothing is generated (a topology that cannot load would fail)
    assert main(common + ["--out", str(tmp_path / "again"), "--topology", str(tmp_path / "missing.yaml")]) == 0
    again = torch.load(tmp_path / "again" / "shard-00001.pt", weights_only=False)
    assert torch.equal(again["tokens"], first["tokens"]) and again["kinds"] == first["kinds"]
    assert again["temperature"] == first["temperature"]
    assert torch.equal(again["topk_ids"], first["topk_ids"])
    meta = json.loads((tmp_path / "again" / "record.json").read_text())
    assert {s["how"] for s in meta["shards"].values()} == {"scored"}


def test_the_pipeline_records_and_trains_a_head_and_a_drafter_into_one_folder(recorded, tmp_path):
    """`cascade pipeline`, the one command for a machine with an accelerator, at toy size on the CPU."""
    root, authority, tok = recorded
    out = tmp_path / "run"
    assert main(["pipeline", "--model", str(authority), "--out", str(out), "--device", "cpu", "--sequences", "8",
                 "--batch", "4", "--user-tokens", "8", "--answer-tokens", "16", "--draft-vocab", "64",
                 "--corpus", str(root / "code"), "--dtype", "float32", "--seq-len", "32", "--batch-size", "4",
                 "--head-minutes", "0.02", "--drafter-size", "1x32", "--drafter-minutes", "0.02"]) == 0
    assert len(list((out / "ids").glob("shard-*.npz"))) == 2
    head, draft = (json.loads((out / d / "training.json").read_text()) for d in ("head", "draft"))
    assert head["steps"] >= 1 and head["draft_vocab"] == 64 and (out / "draft" / "draft_vocab.json").is_file()
    assert draft["steps"] >= 1


def test_measured_dtype_takes_the_faster_products(monkeypatch):
    """--dtype measured: float32 or bfloat16, whichever multiplies the model's weights faster at the
    pass's width, as timed (here a fake clock that each product advances by its dtype's cost)."""
    from cascade.train import record
    from workers.kernels import products

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 16))
    model.device = torch.device("cpu")  # as a transformers model has
    now = [0.0]
    for cheaper, dearer in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        def linear_product(weight, bias, pack, cheaper=cheaper):
            def product(x):
                now[0] += x.shape[0] * weight.numel() * (1.0 if weight.dtype == cheaper else 1.5)
                return x @ weight.T
            return product

        monkeypatch.setattr(products, "linear_product", linear_product)
        for rows in (1, 32, 256):
            assert record.measured_dtype(model, rows, pack=True, clock=lambda: now[0]) == str(cheaper)[6:]


def test_measured_dtype_is_recorded_per_shard(recorded, tmp_path):
    """The default --dtype measured generates and scores each in its measured dtype, named in
    record.json for the run and for each shard; the shards keep their format."""
    root, authority, tok = recorded
    assert main(["record", "--model", str(authority), "--out", str(tmp_path / "m"), "--sequences", "4", "--batch", "4",
                 "--user-tokens", "8", "--answer-tokens", "8", "--top-k", "8", "--corpus", str(root / "code")]) == 0
    meta = json.loads((tmp_path / "m" / "record.json").read_text())
    shard = meta["shards"]["shard-00000.pt"]
    assert {meta["dtype"], meta["score_dtype"]} <= {"float32", "bfloat16"}
    assert (shard["dtype"], shard["score_dtype"]) == (meta["dtype"], meta["score_dtype"])
    saved = torch.load(tmp_path / "m" / "shard-00000.pt", weights_only=False)
    reference = torch.load(root / "rec" / "shard-00000.pt", weights_only=False)
    assert set(saved) == set(reference) and saved["topk_ids"].dtype == reference["topk_ids"].dtype
    assert saved["topk_logprobs"].dtype == torch.float16
