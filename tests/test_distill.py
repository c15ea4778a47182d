"""`cascade distill`: a tiny student trained against a tiny random teacher, interrupted and resumed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cascade.train import distill  # noqa: E402
from cascade.train.corpus import (  # noqa: E402
    WindowSampler,
    collect_files,
    encode_corpus,
    read_texts,
    stdlib_root,
    train_tokenizer,
)

CORPUS_MODULES = ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "colorsys.py", "shlex.py")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """A few real stdlib modules copied into a directory (a corpus given as a directory)."""
    d = tmp_path_factory.mktemp("corpus")
    root = stdlib_root()
    for name in CORPUS_MODULES:
        (d / name).write_text((root / name).read_text(encoding="utf-8"), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, corpus_dir) -> Path:
    """A tiny random-init Llama teacher with its own small BPE tokenizer, saved like a real model."""
    d = tmp_path_factory.mktemp("teacher")
    tok = train_tokenizer(read_texts(collect_files([str(corpus_dir)])), d, vocab_size=400)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                   max_position_embeddings=128, tie_word_embeddings=True,
                                   eos_token_id=tok.eos_token_id)
    torch.manual_seed(123)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _args(teacher_dir, corpus_dir, work, out, *extra):
    return ["distill", "--teacher", str(teacher_dir), "--size", "1x32x2x64", "--corpus", str(corpus_dir),
            "--work-dir", str(work), "--out", str(out), "--steps", "6", "--warmup", "2",
            "--seq-len", "32", "--batch-size", "2", "--threads", "1", "--no-progress", "--amp", "none",
            *extra]


def test_tokenizer_cuts_at_newlines_so_a_prompt_ending_in_one_is_a_prefix(teacher_dir):
    """Text cut right after any newline tokenizes as a prefix of the whole text's tokens (a
    prompt ending in a newline ends where training text does), and decoding is exact."""
    import inspect
    import textwrap as module

    tok = transformers.AutoTokenizer.from_pretrained(teacher_dir)
    src = inspect.getsource(module)
    whole = tok(src, add_special_tokens=False)["input_ids"]
    assert tok.decode(whole) == src
    cuts = [i + 1 for i, ch in enumerate(src) if ch == "\n" and src[i + 1:i + 2] == " "][:200]
    assert len(cuts) > 50  # lines followed by indented code
    for cut in cuts:
        ids = tok(src[:cut], add_special_tokens=False)["input_ids"]
        assert ids == whole[:len(ids)], repr(src[max(0, cut - 40):cut + 20])


def test_sampler_batches_depend_only_on_seed_and_step():
    data = torch.arange(1000, dtype=torch.int32)
    a = WindowSampler(data, 16, 4, seed=7)
    b = WindowSampler(data, 16, 4, seed=7)
    assert torch.equal(a.batch(5), b.batch(5))
    assert not torch.equal(a.batch(5), a.batch(6))
    batch = a.batch(3)
    assert batch.shape == (4, 17)
    # windows are contiguous slices of the corpus
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(4, 16, dtype=torch.long))


def test_lr_schedule_warms_up_then_decays_to_floor():
    peak = 1e-3
    lrs = [distill.lr_at(s, 100, peak, 10, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(peak / 10)
    assert max(lrs) == pytest.approx(peak)
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))
    assert distill.lr_at(100, 100, peak, 10, 0.1) == pytest.approx(0.1 * peak)


def test_distill_trains_interrupts_and_resumes(tmp_path, teacher_dir, corpus_dir):
    # 1. interrupted run: stops (checkpointing) after 3 of 6 steps, saves no model yet
    work, out = tmp_path / "work", tmp_path / "student"
    assert distill.main(_args(teacher_dir, corpus_dir, work, out, "--stop-after", "3")) == 0
    ckpt = torch.load(work / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 3 and ckpt["total_steps"] == 6
    assert not (out / "config.json").exists()

    # 2. the same command again resumes at step 3 and finishes at step 6
    assert distill.main(_args(teacher_dir, corpus_dir, work, out)) == 0
    assert torch.load(work / "checkpoint.pt", weights_only=False)["step"] == 6
    log = (work / "distill.log").read_text()
    assert "resumed from" in log and "at step 3/6" in log
    info = json.loads((out / "training.json").read_text())
    assert info["steps"] == 6 and info["train_tokens"] == 6 * 2 * 32

    # the result loads standalone with the Auto classes and shares the teacher's tokenizer
    student = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    teacher_tok = transformers.AutoTokenizer.from_pretrained(teacher_dir)
    assert tok.get_vocab() == teacher_tok.get_vocab()
    assert student.config.num_hidden_layers == 1 and student.config.hidden_size == 32
    assert student.config.vocab_size == len(tok)
    ids = torch.tensor([tok("def f(x):\n    return x", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = student(input_ids=ids).logits
    assert logits.shape == (1, ids.size(1), len(tok)) and torch.isfinite(logits).all()

    # 3. interrupted + resumed == uninterrupted (same batches, same optimizer state)
    work2, out2 = tmp_path / "work2", tmp_path / "student2"
    assert distill.main(_args(teacher_dir, corpus_dir, work2, out2)) == 0
    ref = transformers.AutoModelForCausalLM.from_pretrained(out2)
    for (name, a), (_, b) in zip(student.state_dict().items(), ref.state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-3), name


def test_distillation_moves_student_towards_teacher(tmp_path, teacher_dir, corpus_dir):
    """After a few dozen KL steps the student's distribution is closer to the teacher's."""
    tok = transformers.AutoTokenizer.from_pretrained(teacher_dir)
    teacher = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    data = encode_corpus(read_texts(collect_files([str(corpus_dir)])), tok)
    x = WindowSampler(data, 32, 4, seed=99).batch(0)[:, :-1]

    def kl_to_teacher(model):
        with torch.no_grad():
            t = torch.log_softmax(teacher(input_ids=x).logits, -1)
            s = torch.log_softmax(model(input_ids=x).logits, -1)
        return torch.nn.functional.kl_div(s, t, log_target=True, reduction="none").sum(-1).mean().item()

    from cascade.train.family import make_model, parse_size

    before = kl_to_teacher(make_model(parse_size("1x32x2x64"), tok, seed=1).eval())
    out = tmp_path / "s"
    args = _args(teacher_dir, corpus_dir, tmp_path / "w", out, "--kl-weight", "1.0", "--lr", "1e-2")
    args[args.index("--steps") + 1] = "30"
    assert distill.main(args) == 0
    after = kl_to_teacher(transformers.AutoModelForCausalLM.from_pretrained(out).float().eval())
    assert after < 0.5 * before


def test_init_continues_from_an_existing_student(tmp_path, teacher_dir, corpus_dir):
    """--init starts from a saved model (its shape, its weights) and records where it came from."""
    first = tmp_path / "first"
    assert distill.main(_args(teacher_dir, corpus_dir, tmp_path / "w1", first)) == 0

    def args(out, work, *extra):
        a = _args(teacher_dir, corpus_dir, work, out, *extra)
        i = a.index("--size")
        return a[:i] + ["--init", str(first)] + a[i + 2:]

    frozen = tmp_path / "frozen"  # learning rate 0: the init comes out unchanged
    assert distill.main(args(frozen, tmp_path / "w2", "--lr", "0")) == 0
    trained = tmp_path / "trained"
    assert distill.main(args(trained, tmp_path / "w3")) == 0
    load = transformers.AutoModelForCausalLM.from_pretrained
    a, b, c = (load(d).state_dict() for d in (first, frozen, trained))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    info = json.loads((trained / "training.json").read_text())
    assert info["init"] == str(first) and info["init_training"]["steps"] == 6
    assert info["size"]["hidden"] == 32 and info["size"]["layers"] == 1
    # the model card counts both trainings and names both teachers
    from cascade.train.family_eval import _teacher_text, _training_total

    assert _training_total(info, "train_tokens") == 2 * 6 * 2 * 32
    assert _training_total(info, "train_seconds") == info["train_seconds"] + info["init_training"]["train_seconds"]
    assert _teacher_text(info) == f"{teacher_dir}, then distilled further from {teacher_dir} (6 steps, KL weight 0.8)"
    # a shape of its own is a contradiction
    assert distill.main(args(tmp_path / "x", tmp_path / "w4", "--size", "1x32")) == 2
    # several at once, one --out each, against one teacher forward per batch
    a = _args(teacher_dir, corpus_dir, tmp_path / "w5", tmp_path / "two-a")
    i = a.index("--size")
    a = a[:i] + ["--init", str(first), "--init", str(trained)] + a[i + 2:] + ["--out", str(tmp_path / "two-b")]
    assert distill.main(a) == 0
    for out, init in (("two-a", first), ("two-b", trained)):
        assert json.loads((tmp_path / out / "training.json").read_text())["init"] == str(init)
    assert any(not torch.equal(c[k], load(tmp_path / "two-b").state_dict()[k]) for k in c)


def test_from_scratch_mode(tmp_path, teacher_dir, corpus_dir):
    out = tmp_path / "base"
    args = ["distill", "--teacher", "none", "--tokenizer", str(teacher_dir), "--size", "1x32x2x64",
            "--corpus", str(corpus_dir), "--work-dir", str(tmp_path / "w"), "--out", str(out),
            "--steps", "40", "--warmup", "4", "--lr", "1e-2", "--seq-len", "32", "--batch-size", "4",
            "--threads", "1", "--no-progress", "--amp", "none", "--eval-corpus", str(corpus_dir)]
    assert distill.main(args) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["teacher"] is None
    # cross-entropy training from scratch gets well below the uniform loss ln(V)
    assert info["eval_loss"] < 0.85 * torch.log(torch.tensor(400.0)).item()


def test_family_mode_builds_all_levels(tmp_path, corpus_dir):
    """`--family` trains tokenizer -> large -> distilled students and saves four loadable levels
    (toy shapes via --level-size to keep this fast; the code path is the real one)."""
    toy = {"tiny": dict(layers=1, hidden=16, heads=2, intermediate=32),
           "small": dict(layers=1, hidden=24, heads=2, intermediate=48),
           "medium": dict(layers=2, hidden=24, heads=2, intermediate=48),
           "large": dict(layers=2, hidden=32, heads=2, intermediate=64)}
    fam = tmp_path / "models"
    shapes = [f"--level-size={lv}={s['layers']}x{s['hidden']}x{s['heads']}x{s['intermediate']}" for lv, s in toy.items()]
    args = ["distill", "--family", str(fam), "--corpus", str(corpus_dir), "--vocab-size", "300", *shapes,
            "--work-dir", str(tmp_path / "w"), "--teacher-steps", "3", "--student-steps", "3", "--warmup", "1",
            "--seq-len", "16", "--batch-size", "2", "--threads", "1", "--no-progress", "--amp", "none"]
    assert distill.main(args) == 0
    for lv in ("tiny", "small", "medium", "large"):
        m = transformers.AutoModelForCausalLM.from_pretrained(fam / lv)
        assert m.config.hidden_size == toy[lv]["hidden"]
        tok = transformers.AutoTokenizer.from_pretrained(fam / lv)
        assert tok.eos_token == "<|endoftext|>"
        info = json.loads((fam / lv / "training.json").read_text())
        assert info["teacher"] == (None if lv == "large" else "large")
        assert (info["device"], info["bf16_autocast"], info["threads"]) == ("cpu", False, 1)
    # running the same command again finds everything done and trains nothing
    assert distill.main(args) == 0
    assert (tmp_path / "w" / "distill.log").read_text().count("large: already trained") == 1

    # the model card of what it built: every part, and the targets as met or missed
    from cascade.cli import main as cli

    card = tmp_path / "card.md"
    assert cli(["model-card", str(fam), "--max-prompts", "3", "--loss-windows", "2", "--decode-rounds", "1",
                "--decode-steps", "2", "--new-tokens", "4", "--text-tokens", "8", "--samples", "2", "--threads", "1",
                "--markdown", str(card), "--json", str(tmp_path / "card.json")]) == 0
    text = card.read_text()
    for part in ("### Held-out loss", "nats/character", "### Text", "# ---- sampled ----", "### Targets",
                 "| one tokenizer shared by every level | shared | yes |", "tokens/param"):
        assert part in text, part
    results = json.loads((tmp_path / "card.json").read_text())
    assert set(results["text"]["greedy_repetition_median"]) == {"tiny", "small", "medium", "large"}
    assert len(results["text"]["samples"]["texts"]) == 2


def test_help_documents_the_family_command(capsys):
    with pytest.raises(SystemExit) as exc:
        distill.main(["distill", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--family", "--teacher", "--size", "--corpus", "--resume", "--device", "--seed"):
        assert flag in out
    text = " ".join(out.split())
    assert "cascade distill --family runs/family --corpus manifest:examples/models/CORPUS.tsv" in text
    assert "examples/models/rebuild.sh" in text  # where the bundled family's full command is


def test_ensemble_teacher_averages_probabilities(teacher_dir):
    a = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    torch.manual_seed(5)
    b = transformers.LlamaForCausalLM(a.config).eval()
    x = torch.randint(0, a.config.vocab_size, (2, 9))
    with torch.no_grad():
        mixed = distill.EnsembleTeacher([a, b])(input_ids=x).logits
        pa, pb = (torch.softmax(m(input_ids=x).logits, -1) for m in (a, b))
    assert torch.allclose(mixed.exp(), (pa + pb) / 2, atol=1e-6)
    assert torch.allclose(mixed.exp().sum(-1), torch.ones(2, 9), atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_asked_for_by_name_is_an_error(tmp_path, teacher_dir, corpus_dir):
    """A worker falls back to the CPU; hours of training on a device not asked for is an error."""
    with pytest.raises(SystemExit, match="--device: device 'cuda' requested but it is not available"):
        distill.main(_args(teacher_dir, corpus_dir, tmp_path / "w", tmp_path / "s", "--device", "cuda"))


def test_distill_loss_mixes_kl_and_ce():
    from cascade.train.trainer import distill_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    loss, ce_out, kl = distill_loss(logits, targets, None, 0.8, 2.0)
    assert kl is None and torch.equal(loss, ce) and torch.equal(ce_out, ce)
    # a teacher equal to the student at temperature T: KL 0, the loss is the CE share alone
    same = torch.log_softmax(logits / 2.0, -1)
    loss, _, kl = distill_loss(logits, targets, same, 0.8, 2.0)
    assert kl.abs() < 1e-6 and torch.allclose(loss, 0.2 * ce)
    other = torch.log_softmax(torch.randn(2, 5, 7), -1)
    loss, _, kl = distill_loss(logits, targets, other, 0.8, 2.0)
    assert kl > 0 and torch.allclose(loss, 0.8 * 4.0 * kl + 0.2 * ce)


def test_sigterm_stops_at_a_step_with_a_checkpoint(tmp_path, teacher_dir):
    """A `kill` mid-stage loses nothing: the step in progress finishes, a checkpoint is written,
    the stage returns interrupted, and the previous SIGTERM handler is back."""
    import os
    import signal

    from cascade.train.family import make_model, parse_size
    from cascade.train.trainer import Optimisation, Session, train_students

    class KillAt(WindowSampler):
        def batch(self, step):
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().batch(step)

    tok = transformers.AutoTokenizer.from_pretrained(teacher_dir)
    model = make_model(parse_size("1x32x2x64"), tok, seed=1)
    before = signal.getsignal(signal.SIGTERM)
    ckpt = tmp_path / "c.pt"
    summary = train_students({"s": model}, None, KillAt(torch.arange(500, dtype=torch.int32) % 300, 16, 2), 10,
                             Optimisation(lr=1e-3, warmup=1), Session(ckpt, progress=False, work_dir=tmp_path))
    assert summary["interrupted"] and summary["steps"] == 3
    assert torch.load(ckpt, weights_only=False)["step"] == 3
    assert "SIGTERM, stopping at step 3/10" in (tmp_path / "distill.log").read_text()
    assert signal.getsignal(signal.SIGTERM) == before


def test_model_card_targets_are_judged_by_their_thresholds():
    from cascade.train.family_eval import check_targets

    levels = ["tiny", "small", "medium", "large"]
    results = {"levels": levels, "shared_tokenizer": True,
               "meta": {lv: {"weights_mib": 9.0} for lv in levels},
               "loss": {"tiny": 3.0, "small": 2.8, "medium": 2.69, "large": 2.6},  # tiny: exactly 0.40 above
               "text": {"greedy_repetition_median": {"large": 0.30}, "new_tokens": 96},
               "decode_ms": {"tiny": 1.0, "small": 2.0, "medium": 4.5, "large": 9.0},
               "acceptance": {kind: {"tiny": {"small": 0.6}, "small": {"medium": 0.7}, "medium": {"large": 0.59}}
                              for kind in ("greedy", "sampled")}}
    met = {key: ok for key, (ok, _) in check_targets(results).items()}
    assert met == {"weights": True, "tokenizer": True, "loss_order": True, "loss_margin_medium": False,
                   "loss_margin_tiny": True, "repetition": True, "decode_cost": True,
                   "acceptance_greedy": False, "acceptance_sampled": False}
    results["meta"]["large"]["weights_mib"] = 14.0  # 41 MiB in all
    results["loss"]["medium"] = 2.7  # exactly 0.10 above large: met
    assert check_targets(results)["weights"][0] is False and check_targets(results)["loss_margin_medium"][0]


def test_repeated_ngram_mask_marks_every_token_of_a_repeat():
    from cascade.train.unlikelihood import repeated_ngram_mask

    ids = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    assert repeated_ngram_mask(ids).tolist() == [
        [False] * 4 + [True] * 4 + [False],  # the second "1 2 3 4", all four of its tokens
        [False] * 9,
    ]


def test_unlikelihood_training_pushes_down_what_greedy_text_repeats(tmp_path, teacher_dir, corpus_dir):
    """--teacher none --init DIR --unlikelihood-every K: a briefly trained model, whose greedy text
    loops, is trained on its own continuations; training.json says how.

    Asserted is what the mechanism guarantees, whatever the processor's floating-point path: the
    tokens of the base model's own greedy text that the mask marks (those inside a repeated
    4-gram) lose their probability, so the unlikelihood loss on them falls by far — at least 10x
    (80x to 15,000x over --seed 0..5 here) — where as many cross-entropy steps raise it (1.8x to
    2.1x). How much less the greedy text then loops is one trajectory's luck, not asserted: median
    repetition 0.85 -> 0.18 .. 0.82 over --seed 0..5 here, and 0.875 -> 0.594 on a Xeon with AMX at
    the seed that gave 0.297 on the machine the test was first written on."""
    from cascade.train.family_eval import _teacher_text
    from cascade.train.unlikelihood import rollout_batch, unlikelihood_loss

    base = tmp_path / "base"
    common = ["--corpus", str(corpus_dir), "--seq-len", "32", "--batch-size", "4", "--threads", "1",
              "--no-progress", "--amp", "none", "--warmup", "2", "--lr", "1e-2",
              "--rollout-prefix", "8", "--rollout-tokens", "32"]
    assert distill.main(["distill", "--teacher", "none", "--tokenizer", str(teacher_dir), "--size", "1x32x2x64",
                         "--work-dir", str(tmp_path / "w1"), "--out", str(base), "--steps", "40", *common]) == 0

    def tune(out, steps, every):
        return distill.main(["distill", "--teacher", "none", "--init", str(base), "--work-dir", str(tmp_path / out),
                             "--out", str(tmp_path / out), "--steps", str(steps),
                             "--unlikelihood-every", str(every), *common])

    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()

    # the base model's greedy continuations of 16 corpus prefixes, and the tokens the mask marks
    data = torch.load(next((tmp_path / "w1").glob("tokens-train-*.pt")))
    inputs, targets, negative, share = rollout_batch(load(base), WindowSampler(data, 8, 16, seed=5).batch(0), 8, 32)
    assert share > 0.5  # the base loops: most of its greedy tokens lie inside a repeated 4-gram

    def penalised_loss(path):
        with torch.no_grad():  # position 7 + j predicts targets[:, j]
            return unlikelihood_loss(load(path)(inputs).logits[:, 7:], targets, negative).item()

    assert tune("ul", 40, 1) == 0  # every step an unlikelihood step
    assert tune("ce", 40, 0) == 0  # the control: as many cross-entropy steps
    before, after, control = penalised_loss(base), penalised_loss(tmp_path / "ul"), penalised_loss(tmp_path / "ce")
    assert after < before / 10 and control > before / 2, (before, after, control)
    # mixed with cross-entropy steps: training.json counts both kinds
    assert tune("mixed", 6, 2) == 0
    info = json.loads((tmp_path / "mixed" / "training.json").read_text())
    assert info["teacher"] is None and info["init"] == str(base)
    assert info["unlikelihood"] == {"every": 2, "steps": 3, "rollout_prefix": 8, "rollout_tokens": 32, "ngram": 4}
    assert info["train_tokens"] == 3 * 4 * 32  # the corpus steps only
    assert _teacher_text(info) == ("none (cross-entropy), then trained further (6 steps, cross-entropy with a "
                                   "sequence-level unlikelihood step every 2)")
    # a family's students follow their teacher: no unlikelihood steps there; bad rollout shapes
    assert distill.main(["distill", "--family", str(tmp_path / "fam"), "--unlikelihood-every", "2"]) == 2
    assert tune("bad", 6, -1) == 2
