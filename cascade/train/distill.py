"""``cascade distill``: train draft models aligned to an authority model by distillation.

Four ways to use it (see ``cascade distill --help``):

* one student against any HF causal-LM teacher::

      cascade distill --teacher examples/models/large --size tiny --corpus stdlib --out runs/tiny

* a model from scratch with plain cross-entropy (``--teacher none``)::

      cascade distill --teacher none --tokenizer examples/models/large --size 2x128 \\
          --corpus my_code/ --out runs/base

* the whole bundled family with ONE command (tokenizer -> large from scratch -> medium, small
  and tiny distilled from the large model, sharing one teacher forward per batch)::

      cascade distill --family examples/models --corpus stdlib

* a feature head (EAGLE-1) for the authority that ``cascade record`` recorded (:mod:`cascade.train.head`)::

      cascade distill --head --records runs/rec --draft-vocab 8192 --out runs/head

* a model continued (``--teacher none --init DIR``) with cross-entropy, every K-th step a
  sequence-level unlikelihood step that trains it away from its own greedy loops
  (``--unlikelihood-every K``, :mod:`cascade.train.unlikelihood`)::

      cascade distill --teacher none --init runs/family/large --unlikelihood-every 2 --corpus src/ --out runs/ul

Every stage checkpoints into ``--work-dir`` (default ``runs/distill``) every
``--checkpoint-minutes`` and on SIGTERM; re-running the same command resumes from the last checkpoint
(automatically, or explicitly with ``--resume``; ``--restart`` discards it).  Batches are a pure
function of ``--seed`` and the step index, so a resumed run trains on exactly the batches an
uninterrupted one would.

``cascade model-card`` (:mod:`cascade.train.family_eval`) measures the numbers published in
``examples/models/README.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from cascade.train.family import LEVELS, SIZES
from cascade.train.session import optimisation, run_record, session, setup_torch, use_amp
from cascade.train.trainer import (  # noqa: F401  (lr_at, EnsembleTeacher: this command's public names)
    EnsembleTeacher,
    Optimisation,
    Session,
    eval_loss,
    log,
    lr_at,
    train_students,
)

DEFAULT_WORK_DIR = "runs/distill"


# --------------------------------------------------------------------------- CLI


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def add_parser(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train draft models (or the whole tiny..large family) by distillation",
        description=(
            "Train a tokenizer-compatible student against an HF causal-LM teacher on a code/text\n"
            "corpus (KL to the teacher's soft targets mixed with cross-entropy), train a model from\n"
            "scratch (--teacher none), or rebuild the whole bundled family with one command.\n"
            "Checkpoints are written to --work-dir and picked up automatically when the same\n"
            "command is re-run."
        ),
        epilog=(
            "examples:\n"
            "  # build a family (tokenizer, large from scratch, medium/small/tiny distilled); the bundled\n"
            "  # one's full command, with its step counts, is examples/models/rebuild.sh\n"
            "  cascade distill --family runs/family --corpus manifest:examples/models/CORPUS.tsv --eval-corpus pkg:attr\n"
            "  # one student (or several: repeat --size/--out) against any HF causal-LM teacher\n"
            "  cascade distill --teacher examples/models/large --size tiny --corpus stdlib --out runs/tiny\n"
            "  cascade distill --teacher my/teacher --size 2x96 --size 4x128 --corpus src/ --steps 2000\n"
            "  # a feature head (EAGLE-1) for the authority that recorded runs/rec, over its draft vocabulary\n"
            "  cascade distill --head --records runs/rec --draft-vocab 8192 --steps 2000 --out runs/head\n"
            "  # continue distilling an existing drafter (its shape and weights) against a teacher\n"
            "  cascade distill --teacher examples/models/large --init examples/models/tiny --kl-weight 1.0 \\\n"
            "      --lr 1e-3 --max-minutes 45 --seed 1 --out runs/tiny-more\n"
            "  # from scratch with cross-entropy, reusing a tokenizer\n"
            "  cascade distill --teacher none --tokenizer examples/models/large --size 2x128 --corpus src/\n"
            "  # continue a model with cross-entropy, every 2nd step trained away from its own greedy loops\n"
            "  # (sequence-level unlikelihood; the bundled large's stage 2 is examples/models/unlikelihood.sh)\n"
            "  cascade distill --teacher none --init runs/family/large --unlikelihood-every 2 --lr 3e-4 \\\n"
            "      --steps 800 --corpus src/ --out runs/large-ul\n"
            "  # measure a family (numbers of examples/models/README.md)\n"
            "  cascade model-card examples/models"
        ),
        formatter_class=_HelpFormatter,
    )
    mode = p.add_argument_group("what to train")
    mode.add_argument("--family", metavar="DIR", help="rebuild the whole family (tokenizer, large from "
                      "scratch, then medium/small/tiny distilled from large) into DIR/{tiny,small,medium,large}")
    mode.add_argument("--level-size", action="append", default=[], metavar="LEVEL=SIZE",
                      help="--family: override a level's shape, e.g. large=16x256x4x640 (SIZE as for --size)")
    mode.add_argument("--records", metavar="DIR", help="train drafters on what `cascade record` wrote "
                      "in DIR: the authority's own conversations and its top-k (no teacher pass); the "
                      "authority's tokenizer is the students'")
    mode.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                      help="--records: trim the students' vocabulary to the N authority tokens with the "
                      "most recorded probability mass (workers.draft_vocab); 0 = the whole vocabulary")
    mode.add_argument("--head", action="store_true",
                      help="--records: train a feature head (EAGLE-1, workers/head.py) for the authority "
                      "instead of drafters, on its features over the recorded conversations (computed once by "
                      "the authority, cached beside the records); --teacher names the authority (default: "
                      "the records'). See cascade/train/head.py")
    mode.add_argument("--teacher", metavar="DIR|none", help="teacher model directory (HF causal LM), "
                      "or 'none' to train from scratch with cross-entropy")
    mode.add_argument("--size", action="append", metavar="SIZE",
                      help=f"student size: a preset {list(SIZES)} or LAYERSxHIDDEN[xHEADS[xFFN]]; "
                      "repeat to train several students against one teacher forward")
    mode.add_argument("--init", action="append", metavar="DIR",
                      help="start the student from this model (same tokenizer) instead of a random "
                      "init: continue distilling an existing drafter, e.g. against a retrained "
                      "teacher; its shape replaces --size. Repeat (with one --out each) to continue "
                      "several against one teacher forward")
    mode.add_argument("--out", action="append", metavar="DIR",
                      help="output directory per --size (same order); default WORK_DIR/<size>")
    mode.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the teacher's; "
                      "with --teacher none and no --tokenizer a new byte-level BPE is trained)")
    mode.add_argument("--vocab-size", type=int, default=4096, help="vocab size when training a tokenizer")

    data = p.add_argument_group("data")
    data.add_argument("--corpus", nargs="+", default=["stdlib"], metavar="PATH",
                      help="files or directories of text/code; the word 'stdlib' selects the Python "
                      "standard library shipped with this interpreter (tests, idlelib, lib2to3 excluded); "
                      "pkg:NAME an installed package; manifest:PATH the files a corpus manifest lists "
                      "(e.g. examples/models/CORPUS.tsv, see python -m cascade.train.packages)")
    data.add_argument("--eval-corpus", nargs="*", default=None, metavar="PATH",
                      help="held-out files/directories/pkg:NAME for the end-of-training loss report")
    data.add_argument("--seq-len", type=int, default=256)
    data.add_argument("--batch-size", type=int, default=8)

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=1000, help="optimizer steps per student (single mode)")
    opt.add_argument("--teacher-steps", type=int, default=2600, help="--family: steps for the large model")
    opt.add_argument("--student-steps", type=int, default=2400, help="--family: steps for the students")
    opt.add_argument("--max-minutes", type=float, default=None,
                     help="single mode: training-time budget; stop early when reached (the cosine "
                     "schedule follows time when that is further along than steps)")
    opt.add_argument("--teacher-minutes", type=float, default=None, help="--family: time budget for the large model")
    opt.add_argument("--student-minutes", type=float, default=None, help="--family: time budget for the students")
    opt.add_argument("--refine-steps", type=int, default=0,
                     help="--family: stage 4, continue training large against the ensemble of the "
                     "distilled medium and small (born-again refinement, KL + CE); 0 = off")
    opt.add_argument("--refine-minutes", type=float, default=None, help="--family: time budget for stage 4")
    opt.add_argument("--refine-lr", type=float, default=6e-4, help="--family: peak LR of stage 4")
    opt.add_argument("--refine-kl-weight", type=float, default=0.5, help="--family: KL weight of stage 4")
    opt.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3 for "
                     "students, 1.5e-3 from scratch)")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine schedule floor / peak")
    opt.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--kl-weight", type=float, default=0.8,
                     help="loss = w * T^2 * KL(teacher || student) + (1-w) * CE")
    opt.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    opt.add_argument("--seed", type=int, default=0)
    opt.add_argument("--unlikelihood-every", type=int, default=0, metavar="K",
                     help="every K-th step is a sequence-level unlikelihood step instead (cascade.train."
                     "unlikelihood): the model writes greedy continuations of corpus prefixes and is "
                     "trained away from their repeated 4-grams, so that its greedy text loops less; "
                     "0 = off. Typically with --teacher none --init DIR")
    opt.add_argument("--rollout-prefix", type=int, default=48, help="unlikelihood steps: prefix tokens per row")
    opt.add_argument("--rollout-tokens", type=int, default=96, help="unlikelihood steps: greedy tokens written per row")

    head = p.add_argument_group("feature head (--head)")
    head.add_argument("--features", metavar="DIR", help="the feature cache (default RECORDS/features); resumed "
                      "shard by shard")
    head.add_argument("--teacher-dtype", choices=["fastest", "float32", "bfloat16"], default="fastest",
                      help="the authority's dtype for the feature pass and the drafting check (fastest: "
                      "bfloat16 where the device computes it natively, else float32)")
    head.add_argument("--head-ffn", type=int, default=0, metavar="N",
                      help="the head's MLP width (0: the authority's intermediate size)")
    head.add_argument("--head-lm-head", choices=["authority", "own"], default="authority",
                      help="authority: logits from the authority's frozen LM head (restricted to the draft "
                      "vocabulary), nothing saved; own: the head trains and ships its own output head, "
                      "initialised from the authority's rows")
    head.add_argument("--reg-weight", type=float, default=None,
                      help="weight of the smooth-L1 feature regression (default 1; 0 with --fuse-layers, as EAGLE-3)")
    head.add_argument("--fuse-layers", metavar="K,K,K", default=None,
                      help="EAGLE-3's fused features: the head reads the inputs of these decoder layers of the "
                      "authority side by side (auto: 2, L/2, L-3), not its last hidden state alone; the feature "
                      "cache keeps them (cascade/train/head_eagle3.py)")
    head.add_argument("--ttt-steps", type=int, default=1, metavar="K",
                      help="EAGLE-3's training-time test: unroll each window K steps, the head fed its own "
                      "predicted features from step 2 on, the loss at every step (1: off; 3 is EAGLE-3's)")
    head.add_argument("--cls-weight", type=float, default=0.1,
                      help="weight of KL(authority || head) on the (draft) vocabulary")
    head.add_argument("--feature-noise", type=float, default=0.0, metavar="A",
                      help="uniform noise of A x the features' RMS on the head's input features in training")
    head.add_argument("--eval-drafts", type=int, default=256, metavar="N",
                      help="held-out positions at which the head drafts 3 tokens greedily for the acceptance "
                      "figures (one authority pass per conversation); 0 = skip")

    run_g = p.add_argument_group("running")
    run_g.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto")
    run_g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    run_g.add_argument("--amp", choices=["auto", "bf16", "none"], default="auto",
                       help="bfloat16 autocast for training forwards: auto = on for CUDA with bf16 and "
                       "for CPUs with AVX512-BF16/AMX (about 1.7x faster there), else off")
    run_g.add_argument("--work-dir", default=DEFAULT_WORK_DIR, help="checkpoints, token caches, logs")
    run_g.add_argument("--checkpoint-minutes", type=float, default=3.0)
    run_g.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                       help="also checkpoint every STEPS steps")
    run_g.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                       help="checkpoint and exit after STEPS steps in this session (chunked training on "
                       "preemptible machines; re-run the same command to continue)")
    rs = run_g.add_mutually_exclusive_group()
    rs.add_argument("--resume", action="store_true",
                    help="resume from the checkpoint in --work-dir (the default when one exists; "
                    "with --resume a missing checkpoint is an error)")
    rs.add_argument("--restart", action="store_true", help="ignore existing checkpoints")
    run_g.add_argument("--save-dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    run_g.add_argument("--no-progress", action="store_true", help="disable tqdm progress bars")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.family:
        if args.unlikelihood_every:
            print("cascade distill: --unlikelihood-every trains one model (--init DIR, or --size); a family's "
                  "students follow their teacher by distillation", file=sys.stderr)
            return 2
        return run_family(args)
    if args.head:
        if not args.records or args.family or args.size or (args.out and len(args.out) > 1) \
                or (args.init and (len(args.init) > 1 or args.draft_vocab)):
            print("cascade distill: --head trains on --records DIR (--teacher: the authority, default the "
                  "records'); its shape is the authority's: no --size or --family; one --out; at most one "
                  "--init (a head folder to continue: its draft vocabulary goes with it, no --draft-vocab)",
                  file=sys.stderr)
            return 2
        from cascade.train.head import run_head

        return run_head(args)
    if args.records:
        if args.teacher or args.init or not args.size:
            print("cascade distill: --records takes its teacher from the records: give --size (and --out), "
                  "no --teacher or --init", file=sys.stderr)
            return 2
        return run_records(args)
    if not args.teacher:
        print("cascade distill: give --teacher DIR|none (or --family DIR)", file=sys.stderr)
        return 2
    if args.init and args.size:
        print("cascade distill: --init takes the student's shape from the model it names: no --size",
              file=sys.stderr)
        return 2
    bad_rollout = not 0 < args.rollout_prefix <= args.seq_len or args.rollout_tokens < 8
    if args.unlikelihood_every < 0 or (args.unlikelihood_every and bad_rollout):
        print("cascade distill: --unlikelihood-every must be >= 0, --rollout-prefix within 1..--seq-len and "
              "--rollout-tokens >= 8", file=sys.stderr)
        return 2
    if not args.size and not args.init:
        print("cascade distill: give at least one --size (or --init DIR)", file=sys.stderr)
        return 2
    return run_single(args)


# --------------------------------------------------------------------------- helpers


def load_corpus_tokens(specs, tokenizer, work_dir: Path, tag: str):
    """Token ids of the corpus, cached in work_dir keyed by the file list and tokenizer."""
    import hashlib

    from cascade.train.corpus import collect_files, encode_corpus, read_texts

    files = collect_files(specs)
    vocab_sig = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:12]
    key = hashlib.sha256(("\n".join(str(f.resolve()) for f in files) + vocab_sig).encode()).hexdigest()[:12]
    cache = work_dir / f"tokens-{tag}-{key}.pt"
    data = encode_corpus(read_texts(files), tokenizer, cache=cache)
    return files, data


def _training_record(model_dir: str | None) -> dict | None:
    """The training.json of the model a student was initialised from (its earlier training)."""
    if not model_dir or not (Path(model_dir) / "training.json").exists():
        return None
    return json.loads((Path(model_dir) / "training.json").read_text())


def _eval_windows(args, tokenizer, work_dir: Path, max_windows: int = 48):
    from cascade.train.corpus import fixed_windows

    if not args.eval_corpus:
        return None
    _, data = load_corpus_tokens(args.eval_corpus, tokenizer, work_dir, "eval")
    return fixed_windows(data, args.seq_len, max_windows)


def _train_tokenizer(corpus, tok_dir: Path, vocab_size: int, work_dir: Path) -> None:
    from cascade.train.corpus import collect_files, read_texts, train_tokenizer

    files = collect_files(corpus)
    log(f"training a {vocab_size}-token byte-level BPE on {len(files)} files", work_dir)
    train_tokenizer(read_texts(files), tok_dir, vocab_size)


def _load_float32(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


# --------------------------------------------------------------------------- single mode


def run_single(args) -> int:
    """One or more students against one teacher (or from scratch), saved to --out."""
    from cascade.train.corpus import WindowSampler

    device = setup_torch(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, teacher = _single_tokenizer_and_teacher(args, work_dir)
    init, init_sizes = _single_init(args, teacher)
    names, sizes, outs = _single_plan(args, init_sizes, work_dir)
    files, data = load_corpus_tokens(args.corpus, tokenizer, work_dir, "train")
    log(f"corpus: {len(files)} files, {data.numel():,} tokens", work_dir)
    sampler = WindowSampler(data, args.seq_len, args.batch_size, seed=args.seed)
    students = _single_students(args, names, sizes, tokenizer, teacher, init, work_dir)
    lr = args.lr if args.lr is not None else (1.5e-3 if teacher is None else 2e-3)
    opt = optimisation(args, device, lr, warmup=min(args.warmup, max(1, args.steps // 10)))
    summary = train_students(
        students, teacher, sampler, args.steps, opt,
        session(args, work_dir / "checkpoint.pt", args.max_minutes,
                 "distill" if teacher is not None else "train"),
        device)
    if summary["interrupted"]:
        return 0
    _save_single(args, students, outs, sizes, summary, tokenizer, lr, teacher is None, device, opt)
    return 0


def _unlikelihood_record(opt: Optimisation, steps: int) -> dict | None:
    """training.json's account of the unlikelihood steps among ``steps`` (None when off)."""
    from cascade.train.unlikelihood import NGRAM

    if not opt.unlikelihood_every:
        return None
    return {"every": opt.unlikelihood_every, "steps": opt.unlikelihood_steps(steps),
            "rollout_prefix": opt.rollout_prefix, "rollout_tokens": opt.rollout_tokens, "ngram": NGRAM}


def _single_tokenizer_and_teacher(args, work_dir: Path):
    """(tokenizer, teacher model or None): the teacher's tokenizer, --tokenizer, or (from scratch
    without one) a BPE trained on the corpus and kept in the work dir."""
    from cascade.train.corpus import load_tokenizer

    if args.teacher.lower() != "none":
        tokenizer = load_tokenizer(args.tokenizer or args.teacher)
        teacher = _load_float32(args.teacher)
        if teacher.get_input_embeddings().weight.shape[0] < len(tokenizer):
            raise SystemExit("cascade distill: the teacher's vocabulary is smaller than the tokenizer's")
        return tokenizer, teacher
    if args.tokenizer or args.init:
        return load_tokenizer(args.tokenizer or args.init[0]), None
    tok_dir = work_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists() or args.restart:
        _train_tokenizer(args.corpus, tok_dir, args.vocab_size, work_dir)
    return load_tokenizer(tok_dir), None


def _single_init(args, teacher):
    """([the --init models], [their shapes]), or (None, None); each model's directory name
    becomes its --size (its name)."""
    if not args.init:
        return None, None
    models, sizes = [], []
    for path in args.init:
        init = _load_float32(path)
        if teacher is not None and init.config.vocab_size != teacher.config.vocab_size:
            raise SystemExit(f"cascade distill: --init {path} has a vocabulary of {init.config.vocab_size}, "
                             f"the teacher {teacher.config.vocab_size}")
        c = init.config
        models.append(init)
        sizes.append(dict(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                          intermediate=c.intermediate_size))
    args.size = [Path(path).name or "init" for path in args.init]
    return models, sizes


def _single_plan(args, init_sizes: list | None, work_dir: Path):
    """(names, sizes, output dirs) of the students, one each per --size."""
    from cascade.train.family import parse_size

    sizes = init_sizes or [parse_size(s) for s in args.size]
    outs = args.out or []
    if len(outs) not in (0, len(sizes)):
        raise SystemExit("cascade distill: give one --out per --size (or none)")
    names = [s.replace("/", "_") for s in args.size]
    if len(set(names)) != len(names):
        names = [f"{n}-{i}" for i, n in enumerate(names)]
    return names, sizes, outs or [str(work_dir / n) for n in names]


def _single_students(args, names, sizes, tokenizer, teacher, init, work_dir: Path) -> dict:
    from cascade.train.family import count_params, make_model

    students = {}
    for i, (name, size) in enumerate(zip(names, sizes)):
        if init is not None:
            students[name] = init[i]
            log(f"student {name}: initialised from {args.init[i]}", work_dir)
            continue
        students[name] = make_model(size, tokenizer, seed=args.seed + 1 + i, max_positions=max(1024, args.seq_len))
        if teacher is not None and students[name].config.vocab_size != teacher.config.vocab_size:
            students[name].resize_token_embeddings(teacher.config.vocab_size)
        log(f"student {name}: {size} -> {count_params(students[name]):,} params", work_dir)
    return students


def _save_single(args, students, outs, sizes, summary, tokenizer, lr: float, scratch: bool, device,
                 opt: Optimisation) -> None:
    """Each student with its training.json (and held-out loss, given --eval-corpus) to its --out."""
    from cascade.train.family import save_model

    work_dir = Path(args.work_dir)
    windows = _eval_windows(args, tokenizer, work_dir)
    inits = args.init or [None] * len(outs)
    for (name, model), out, size, init in zip(students.items(), outs, sizes, inits):
        extra = {"size": size, "steps": summary["steps"], "seq_len": args.seq_len, "batch_size": args.batch_size,
                 "teacher": None if scratch else str(args.teacher), "kl_weight": args.kl_weight,
                 "init": init, "init_training": _training_record(init),
                 "temperature": args.temperature, "lr": lr, "seed": args.seed,
                 "train_tokens": (summary["steps"] - opt.unlikelihood_steps(summary["steps"]))
                 * args.batch_size * args.seq_len,
                 "unlikelihood": _unlikelihood_record(opt, summary["steps"]),
                 "train_seconds": round(summary["train_seconds"], 1), "corpus": list(args.corpus),
                 "final_train_ce": summary["history"][name][-1][1] if summary["history"][name] else None,
                 **run_record(args, device)}
        if windows is not None:
            extra["eval_loss"] = eval_loss(model, windows)
            log(f"{name}: held-out loss {extra['eval_loss']:.4f}", work_dir)
        save_model(model, tokenizer, out, dtype=args.save_dtype, extra=extra)
        log(f"saved {name} -> {out}", work_dir)


# --------------------------------------------------------------------------- records mode


def run_records(args) -> int:
    """Students with a (trimmed) draft vocabulary, trained on recorded teacher top-k."""
    from transformers import AutoConfig

    from cascade.pull import PULLED, resolve_pulled
    from cascade.train.corpus import load_tokenizer
    from cascade.train.records import RecordSampler, choose_draft_vocab, load_records
    from workers.draft_vocab import DraftVocab

    device = setup_torch(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    train = load_records(args.records, held_out=False)
    ref = train.authority
    authority = str(resolve_pulled(ref)) if ref.startswith(PULLED) else ref
    tokenizer = load_tokenizer(authority)
    vocab_size = AutoConfig.from_pretrained(authority).vocab_size
    ids, covered = choose_draft_vocab(train, args.draft_vocab or vocab_size, vocab_size, tokenizer.all_special_ids)
    vocab = DraftVocab(ids, vocab_size)
    log(f"records: {train.tokens.numel():,} tokens from {args.records} (authority {ref}); draft vocabulary "
        f"{len(ids)} tokens covering {covered:.4f} of the recorded mass", work_dir)
    names, sizes, outs = _single_plan(args, None, work_dir)
    students = {name: _draft_student(size, tokenizer, vocab, args.seed + 1 + i, args.seq_len)
                for i, (name, size) in enumerate(zip(names, sizes))}
    sampler = RecordSampler(train, vocab, args.seq_len, args.batch_size, seed=args.seed)
    lr = args.lr if args.lr is not None else 2e-3
    opt = optimisation(args, device, lr, warmup=min(args.warmup, max(1, args.steps // 10)))
    summary = train_students(students, None, sampler, args.steps, opt,
                             session(args, work_dir / "checkpoint.pt", args.max_minutes, "distill"), device)
    if summary["interrupted"]:
        return 0
    _save_records_students(args, students, outs, sizes, summary, tokenizer, vocab, covered, lr, device)
    return 0


def _draft_student(size, tokenizer, vocab, seed: int, seq_len: int):
    from cascade.train.family import make_model

    model = make_model(size, tokenizer, seed=seed, max_positions=max(1024, seq_len))
    model.resize_token_embeddings(vocab.size)
    bos, eos, pad = vocab.to_draft([tokenizer.bos_token_id or 0, tokenizer.eos_token_id or 0,
                                   tokenizer.pad_token_id or 0])
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = bos, eos, pad
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = bos, eos
    return model


def _save_records_students(args, students, outs, sizes, summary, tokenizer, vocab, covered: float, lr: float,
                           device) -> None:
    from cascade.train.family import count_params, save_model
    from cascade.train.records import RecordSampler, evaluate, load_records

    work_dir = Path(args.work_dir)
    held = RecordSampler(load_records(args.records, held_out=True), vocab, args.seq_len, args.batch_size)
    for (name, model), out, size in zip(students.items(), outs, sizes):
        metrics = evaluate(model, held)
        log(f"{name}: held-out {metrics}", work_dir)
        extra = {"size": size, "params": count_params(model), "steps": summary["steps"], "seq_len": args.seq_len,
                 "batch_size": args.batch_size, "records": str(args.records), "draft_vocab": len(vocab.ids),
                 "draft_vocab_coverage": covered, "lr": lr, "seed": args.seed,
                 "train_positions": summary["steps"] * args.batch_size * args.seq_len,
                 "train_seconds": round(summary["train_seconds"], 1), "held_out": metrics,
                 **run_record(args, device)}
        save_model(model, tokenizer, out, dtype=args.save_dtype, extra=extra)
        vocab.save(out, coverage=covered)
        log(f"saved {name} -> {out}", work_dir)


# --------------------------------------------------------------------------- family mode


@dataclass
class _Family:
    """What every stage of a family build shares: the command's arguments, where things go, the
    level shapes, the tokenizer, the corpus tokens and the held-out windows."""

    args: argparse.Namespace
    device: object
    work_dir: Path
    family_dir: Path
    sizes: dict
    tokenizer: object
    data: object  # the corpus as one int32 token tensor
    n_files: int
    windows: object  # held-out windows [n, seq_len + 1], or None

    def sampler(self, seed_offset: int):
        from cascade.train.corpus import WindowSampler

        args = self.args
        return WindowSampler(self.data, args.seq_len, args.batch_size, seed=args.seed + seed_offset)

    def record(self, level: str, summary: dict, lr: float, teacher: str | None) -> dict:
        """The training.json of a level trained by one stage."""
        args, steps = self.args, summary["steps"]
        return {"level": level, "size": self.sizes[level], "steps": steps, "seq_len": args.seq_len,
                "batch_size": args.batch_size, "train_tokens": steps * args.batch_size * args.seq_len,
                "train_seconds": round(summary["train_seconds"], 1), "lr": lr, "seed": args.seed,
                "teacher": teacher, "kl_weight": None if teacher is None else args.kl_weight,
                "temperature": None if teacher is None else args.temperature,
                "corpus": list(args.corpus), "corpus_files": self.n_files, "corpus_tokens": int(self.data.numel()),
                "final_train_ce": summary["history"][level][-1][1] if summary["history"][level] else None,
                **run_record(args, self.device)}

    def held_out(self, name: str, model, record: dict) -> None:
        if self.windows is not None:
            record["eval_loss"] = eval_loss(model, self.windows)
            log(f"{name}: held-out loss {record['eval_loss']:.4f}", self.work_dir)


def run_family(args) -> int:
    """tokenizer -> large from scratch -> medium/small/tiny distilled from it -> (optionally) large
    refined against the ensemble of medium and small. Each stage is skipped once done, so
    re-running the command resumes where it stopped."""
    device = setup_torch(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    sizes = _family_sizes(args.level_size)
    log(f"family build -> {Path(args.family)} (work dir {work_dir}, device {device}, "
        f"bf16 autocast {use_amp(args.amp, device)})", work_dir)
    tok_dir = work_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists() or args.restart:
        _train_tokenizer(args.corpus, tok_dir, args.vocab_size, work_dir)
    from cascade.train.corpus import load_tokenizer

    tokenizer = load_tokenizer(tok_dir)
    files, data = load_corpus_tokens(args.corpus, tokenizer, work_dir, "train")
    log(f"corpus: {len(files)} files, {data.numel():,} tokens", work_dir)
    fam = _Family(args, device, work_dir, Path(args.family), sizes, tokenizer, data, len(files),
                  _eval_windows(args, tokenizer, work_dir))
    large = _family_large(fam)
    if large is None or not _family_students(fam, large) or not _family_refine(fam, large):
        return 0  # a stage stopped early (--stop-after): re-run to resume
    log("family build complete", work_dir)
    return 0


def _family_sizes(overrides: list[str]) -> dict:
    from cascade.train.family import parse_size

    sizes = {lv: dict(SIZES[lv]) for lv in LEVELS}
    for item in overrides:
        lv, _, spec = item.partition("=")
        if lv not in sizes or not spec:
            raise SystemExit(f"cascade distill: bad --level-size {item!r} (levels: {list(LEVELS)})")
        sizes[lv] = parse_size(spec)
    return sizes


def _family_large(fam: _Family):
    """Stage 2: the authority from scratch (cross-entropy), or the one already trained; frozen on
    the device. None when the stage stopped early."""
    from cascade.train.family import count_params, make_model, save_model

    args, done_dir = fam.args, fam.work_dir / "large" / "final"
    if (done_dir / "config.json").exists() and not args.restart:
        log("large: already trained, loading", fam.work_dir)
        large = _load_float32(done_dir)
    else:
        large = make_model(fam.sizes["large"], fam.tokenizer, seed=args.seed + 4,
                           max_positions=max(1024, args.seq_len))
        log(f"large: {count_params(large):,} params, {args.teacher_steps} steps from scratch", fam.work_dir)
        sampler = fam.sampler(0)
        lr = args.lr if args.lr is not None else 1.5e-3
        summary = train_students(
            {"large": large}, None, sampler, args.teacher_steps,
            optimisation(args, fam.device, lr, args.warmup),
            session(args, fam.work_dir / "large" / "checkpoint.pt", args.teacher_minutes, "large"), fam.device)
        if summary["interrupted"]:
            return None
        record = fam.record("large", summary, lr, None)
        fam.held_out("large", large, record)
        # keep a float32 copy for distillation; publish a float16 copy
        save_model(large, fam.tokenizer, done_dir, dtype="float32", extra=record)
        save_model(large, fam.tokenizer, fam.family_dir / "large", dtype=args.save_dtype, extra=record)
        log(f"large: saved -> {fam.family_dir / 'large'}", fam.work_dir)
    large.to(fam.device).eval()
    for p in large.parameters():
        p.requires_grad_(False)
    return large


def _family_students(fam: _Family, large) -> bool:
    """Stage 3: tiny, small and medium distilled from large, one shared teacher forward per batch.
    False when the stage stopped early."""
    from cascade.train.family import count_params, make_model, save_model

    args, levels = fam.args, [lv for lv in LEVELS if lv != "large"]
    marker = fam.work_dir / "students" / "done"
    if not args.restart and marker.exists() and all((fam.family_dir / lv / "config.json").exists()
                                                    for lv in levels):
        return True
    students = {lv: make_model(fam.sizes[lv], fam.tokenizer, seed=args.seed + 1 + i,
                               max_positions=max(1024, args.seq_len)) for i, lv in enumerate(levels)}
    for lv, m in students.items():
        log(f"{lv}: {count_params(m):,} params, distilled from large for {args.student_steps} steps", fam.work_dir)
    sampler = fam.sampler(1)
    lr = args.lr if args.lr is not None else 2e-3
    summary = train_students(
        students, large, sampler, args.student_steps, optimisation(args, fam.device, lr, args.warmup),
        session(args, fam.work_dir / "students" / "checkpoint.pt", args.student_minutes, "students"),
        fam.device)
    if summary["interrupted"]:
        return False
    for lv, m in students.items():
        record = fam.record(lv, summary, lr, "large")
        fam.held_out(lv, m, record)
        save_model(m, fam.tokenizer, fam.family_dir / lv, dtype=args.save_dtype, extra=record)
        log(f"{lv}: saved -> {fam.family_dir / lv}", fam.work_dir)
    marker.write_text("ok\n")
    return True


def _family_refine(fam: _Family, large) -> bool:
    """Stage 4 (--refine-steps > 0): large trained further against the ensemble of the distilled
    medium and small (born-again refinement, KL + CE). False when the stage stopped early."""
    from cascade.train.family import save_model

    args, refine_dir = fam.args, fam.work_dir / "refine"
    if args.refine_steps <= 0 or (not args.restart and (refine_dir / "done").exists()):
        return True
    teacher = EnsembleTeacher([_load_float32(fam.family_dir / lv).to(fam.device).eval()
                               for lv in ("medium", "small")])
    sampler = fam.sampler(2)
    for p in large.parameters():
        p.requires_grad_(True)
    log(f"large: refining against the ensemble of medium+small for {args.refine_steps} steps", fam.work_dir)
    summary = train_students(
        {"large": large}, teacher, sampler, args.refine_steps,
        optimisation(args, fam.device, args.refine_lr, min(args.warmup, 20),
                      kl_weight=args.refine_kl_weight, temperature=1.0),
        session(args, refine_dir / "checkpoint.pt", args.refine_minutes, "refine"), fam.device)
    if summary["interrupted"]:
        return False
    info = json.loads((fam.work_dir / "large" / "final" / "training.json").read_text())
    info["refine"] = {"teacher": "ensemble(medium, small)", "steps": summary["steps"],
                      "train_tokens": summary["steps"] * args.batch_size * args.seq_len,
                      "train_seconds": round(summary["train_seconds"], 1), "lr": args.refine_lr,
                      "kl_weight": args.refine_kl_weight}
    info["train_tokens"] += info["refine"]["train_tokens"]
    info["train_seconds"] = round(info["train_seconds"] + info["refine"]["train_seconds"], 1)
    fam.held_out("large (refined)", large, info)
    save_model(large, fam.tokenizer, fam.family_dir / "large", dtype=args.save_dtype, extra=info)
    save_model(large, fam.tokenizer, refine_dir / "final", dtype="float32", extra=info)
    (refine_dir / "done").write_text("ok\n")
    log(f"large (refined): saved -> {fam.family_dir / 'large'}", fam.work_dir)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cascade")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
