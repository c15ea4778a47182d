"""``cascade distill``: train draft models aligned to an authority model by distillation.

Three ways to use it (see ``cascade distill --help``):

* one student against any HF causal-LM teacher::

      cascade distill --teacher examples/models/large --size tiny --corpus stdlib --out runs/tiny

* a model from scratch with plain cross-entropy (``--teacher none``)::

      cascade distill --teacher none --tokenizer examples/models/large --size 2x128 \\
          --corpus my_code/ --out runs/base

* the whole bundled family with ONE command (tokenizer -> large from scratch -> medium, small
  and tiny distilled from the large model, sharing one teacher forward per batch)::

      cascade distill --family examples/models --corpus stdlib

Every stage checkpoints into ``--work-dir`` (default ``runs/distill``) every
``--checkpoint-minutes``; re-running the same command resumes from the last checkpoint
(automatically, or explicitly with ``--resume``; ``--restart`` discards it).  Batches are a pure
function of ``--seed`` and the step index, so a resumed run trains on exactly the batches an
uninterrupted one would.

``cascade model-card`` (:mod:`cascade.train.family_eval`) measures the numbers published in
``examples/models/README.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from cascade.train.family import LEVELS, SIZES

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
            "  # rebuild the bundled family (tokenizer, large from scratch, medium/small/tiny distilled)\n"
            "  cascade distill --family examples/models --corpus stdlib --eval-corpus pkg:attr\n"
            "  # one student (or several: repeat --size/--out) against any HF causal-LM teacher\n"
            "  cascade distill --teacher examples/models/large --size tiny --corpus stdlib --out runs/tiny\n"
            "  cascade distill --teacher my/teacher --size 2x96 --size 4x128 --corpus src/ --steps 2000\n"
            "  # continue distilling an existing drafter (its shape and weights) against a teacher\n"
            "  cascade distill --teacher examples/models/large --init examples/models/tiny --kl-weight 1.0 \\\n"
            "      --lr 1e-3 --max-minutes 45 --seed 1 --out runs/tiny-more\n"
            "  # from scratch with cross-entropy, reusing a tokenizer\n"
            "  cascade distill --teacher none --tokenizer examples/models/large --size 2x128 --corpus src/\n"
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
    mode.add_argument("--teacher", metavar="DIR|none", help="teacher model directory (HF causal LM), "
                      "or 'none' to train from scratch with cross-entropy")
    mode.add_argument("--size", action="append", metavar="SIZE",
                      help=f"student size: a preset {list(SIZES)} or LAYERSxHIDDEN[xHEADS[xFFN]]; "
                      "repeat to train several students against one teacher forward")
    mode.add_argument("--init", metavar="DIR",
                      help="start the student from this model (same tokenizer) instead of a random "
                      "init: continue distilling an existing drafter, e.g. against a retrained "
                      "teacher; its shape replaces --size")
    mode.add_argument("--out", action="append", metavar="DIR",
                      help="output directory per --size (same order); default WORK_DIR/<size>")
    mode.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the teacher's; "
                      "with --teacher none and no --tokenizer a new byte-level BPE is trained)")
    mode.add_argument("--vocab-size", type=int, default=4096, help="vocab size when training a tokenizer")

    data = p.add_argument_group("data")
    data.add_argument("--corpus", nargs="+", default=["stdlib"], metavar="PATH",
                      help="files or directories of text/code; the word 'stdlib' selects the Python "
                      "standard library shipped with this interpreter (tests, idlelib, lib2to3 excluded)")
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
        return run_family(args)
    if not args.teacher:
        print("cascade distill: give --teacher DIR|none (or --family DIR)", file=sys.stderr)
        return 2
    if args.init and (args.size or args.teacher.lower() == "none"):
        print("cascade distill: --init takes the student's shape from the model it names: no --size; "
              "and it needs a --teacher", file=sys.stderr)
        return 2
    if not args.size and not args.init:
        print("cascade distill: give at least one --size (or --init DIR)", file=sys.stderr)
        return 2
    return run_single(args)


# --------------------------------------------------------------------------- helpers


def resolve_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cascade distill: --device cuda requested but CUDA is not available")
    return torch.device(name)


def use_amp(name: str, device) -> bool:
    """Whether to train under bfloat16 autocast (see --amp)."""
    import torch

    if name == "none":
        return False
    if name == "bf16":
        return True
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _setup_torch(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return resolve_device(args.device)


def log(msg: str, work_dir: Path | None = None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        with open(work_dir / "distill.log", "a") as fh:
            fh.write(line + "\n")


def lr_at(step: int, total: int, peak: float, warmup: int, floor_ratio: float,
          progress: float | None = None) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor_ratio * peak``.

    ``progress`` (0..1) overrides ``step / total`` for the cosine (time-budgeted runs use
    ``max(step / total, elapsed / budget)``).
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    if progress is None:
        progress = (step - warmup) / max(1, total - warmup)
    progress = min(1.0, max(0.0, progress))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _atomic_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


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


# --------------------------------------------------------------------------- training core


def train_students(
    students: dict,
    teacher,
    sampler,
    steps: int,
    *,
    ckpt_path: Path,
    lr: float,
    warmup: int,
    min_lr_ratio: float = 0.1,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    kl_weight: float = 0.8,
    temperature: float = 1.0,
    device=None,
    amp: bool = False,
    checkpoint_minutes: float = 3.0,
    checkpoint_every: int | None = None,
    time_budget_minutes: float | None = None,
    stop_after: int | None = None,
    resume: str = "auto",
    progress: bool = True,
    desc: str = "train",
    work_dir: Path | None = None,
) -> dict:
    """Train every model in ``students`` (name -> LlamaForCausalLM) for ``steps`` steps.

    With a ``teacher`` the loss is ``kl_weight * T^2 * KL(p_teacher^T || p_student^T) +
    (1 - kl_weight) * CE``, the teacher's forward being computed once per batch and shared by
    all students; without one it is plain next-token cross-entropy.  State (weights, optimizer,
    step, running losses) is checkpointed atomically to ``ckpt_path``; ``resume`` is
    ``"auto"`` (resume if present), ``"require"`` or ``"never"``.  With
    ``time_budget_minutes`` training stops early once that much training time (summed over
    resumed sessions) has passed, the cosine schedule following whichever of step- or
    time-progress is further along.  Returns a summary dict (``steps`` = steps actually done).
    """
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    device = device or torch.device("cpu")
    opts = {}
    for name, model in students.items():
        model.to(device).train()
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        opts[name] = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=(0.9, 0.95), eps=1e-8,
        )
    if teacher is not None:
        teacher.to(device).eval()

    start, history, elapsed_before = 0, {n: [] for n in students}, 0.0
    if resume != "never" and ckpt_path.exists():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        if set(state["students"]) != set(students):
            raise SystemExit(f"checkpoint {ckpt_path} holds {sorted(state['students'])}, "
                             f"not {sorted(students)}; use --restart or another --work-dir")
        for name, model in students.items():
            model.load_state_dict(state["students"][name]["model"])
            opts[name].load_state_dict(state["students"][name]["optim"])
        start, history = state["step"], state.get("history", history)
        elapsed_before = state.get("elapsed", 0.0)
        log(f"{desc}: resumed from {ckpt_path} at step {start}/{steps}", work_dir)
    elif resume == "require":
        raise SystemExit(f"cascade distill: --resume given but no checkpoint at {ckpt_path}")

    def save(step):
        _atomic_save({
            "step": step,
            "total_steps": steps,
            "students": {n: {"model": m.state_dict(), "optim": opts[n].state_dict()} for n, m in students.items()},
            "history": history,
            "elapsed": elapsed_before + time.time() - t_start,
        }, ckpt_path)

    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    t_start = last_ckpt = time.time()
    bar = tqdm(total=steps, initial=start, desc=desc, disable=not progress, dynamic_ncols=True,
               mininterval=2.0)
    running = {n: None for n in students}
    tokens = 0
    budget_s = time_budget_minutes * 60 if time_budget_minutes else None
    done = start
    for step in range(start, steps):
        elapsed = elapsed_before + time.time() - t_start
        if budget_s is not None and elapsed >= budget_s:
            log(f"{desc}: time budget of {time_budget_minutes} min reached at step {step}/{steps}", work_dir)
            break
        if stop_after is not None and step - start >= stop_after:
            log(f"{desc}: stopping after {stop_after} steps this session (at step {step}/{steps}); "
                "re-run to resume", work_dir)
            save(step)
            return {"steps": step, "history": history, "interrupted": True,
                    "train_seconds": elapsed_before + time.time() - t_start}
        progress = None
        if budget_s is not None:
            progress = max((step - warmup) / max(1, steps - warmup), elapsed / budget_s)
        batch = sampler.batch(step).to(device)
        x, y = batch[:, :-1], batch[:, 1:]
        cur_lr = lr_at(step, steps, lr, warmup, min_lr_ratio, progress)
        t_logp = None
        if teacher is not None:
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                t_logits = teacher(input_ids=x).logits.float()
                t_logp = F.log_softmax(t_logits / temperature, dim=-1)
                del t_logits
        post = {}
        for name, model in students.items():
            for g in opts[name].param_groups:
                g["lr"] = cur_lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(input_ids=x).logits
            logits = logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            if t_logp is not None:
                s_logp = F.log_softmax(logits / temperature, dim=-1)
                kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="none").sum(-1).mean()
                loss = kl_weight * temperature**2 * kl + (1 - kl_weight) * ce
            else:
                kl = None
                loss = ce
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            val = ce.item()
            running[name] = val if running[name] is None else 0.95 * running[name] + 0.05 * val
            post[name] = f"{running[name]:.3f}" + (f"/kl{kl.item():.3f}" if kl is not None else "")
        tokens += x.numel()
        bar.update(1)
        bar.set_postfix(post, refresh=False)
        done = step + 1
        if done % 50 == 0 or done == steps:
            for n in students:
                history[n].append((done, running[n]))
            log(f"{desc}: step {done}/{steps} lr {cur_lr:.2e} " + " ".join(f"{n}={v}" for n, v in post.items())
                + f" tok/s {tokens / max(1e-9, time.time() - t_start):.0f}", work_dir if not progress else work_dir)
        if done < steps and ((time.time() - last_ckpt) >= checkpoint_minutes * 60
                             or (checkpoint_every and done % checkpoint_every == 0)):
            save(done)
            last_ckpt = time.time()
    bar.close()
    if done > start or not ckpt_path.exists():
        save(done)
    for model in students.values():
        model.eval()
    return {"steps": done, "history": history, "interrupted": False,
            "train_seconds": elapsed_before + time.time() - t_start}



class EnsembleTeacher:
    """Averages the next-token distributions of several causal LMs (same tokenizer).

    Called like a model; ``.logits`` are the log of the mean probability (a valid logit vector).
    """

    def __init__(self, members):
        self.members = list(members)

    def to(self, device):
        self.members = [m.to(device) for m in self.members]
        return self

    def eval(self):
        for m in self.members:
            m.eval()
        return self

    def __call__(self, input_ids):
        import torch
        from types import SimpleNamespace

        logps = [torch.log_softmax(m(input_ids=input_ids).logits.float(), -1) for m in self.members]
        mixed = torch.logsumexp(torch.stack(logps), 0) - math.log(len(logps))
        return SimpleNamespace(logits=mixed)


def eval_loss(model, windows, device=None, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over fixed windows [n, L+1]."""
    import torch
    import torch.nn.functional as F

    device = device or next(model.parameters()).device
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, windows.size(0), batch_size):
            b = windows[i : i + batch_size].to(device)
            logits = model(input_ids=b[:, :-1]).logits.float()
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1),
                                     reduction="sum").item()
            count += b[:, 1:].numel()
    return total / max(1, count)


def _training_record(model_dir: str | None) -> dict | None:
    """The training.json of the model a student was initialised from (its earlier training)."""
    if not model_dir or not (Path(model_dir) / "training.json").exists():
        return None
    return json.loads((Path(model_dir) / "training.json").read_text())


def _resume_mode(args) -> str:
    return "require" if args.resume else ("never" if args.restart else "auto")


def _eval_windows(args, tokenizer, work_dir: Path, max_windows: int = 48):
    from cascade.train.corpus import fixed_windows

    if not args.eval_corpus:
        return None
    _, data = load_corpus_tokens(args.eval_corpus, tokenizer, work_dir, "eval")
    return fixed_windows(data, args.seq_len, max_windows)


# --------------------------------------------------------------------------- single mode


def run_single(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from cascade.train.corpus import WindowSampler, collect_files, load_tokenizer, read_texts, train_tokenizer
    from cascade.train.family import count_params, make_model, parse_size, save_model

    device = _setup_torch(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    scratch = args.teacher.lower() == "none"
    teacher = None
    if scratch:
        if args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            tok_dir = work_dir / "tokenizer"
            if (tok_dir / "tokenizer.json").exists() and not args.restart:
                tokenizer = load_tokenizer(tok_dir)
            else:
                log(f"training a {args.vocab_size}-token byte-level BPE on {args.corpus}", work_dir)
                tokenizer = train_tokenizer(read_texts(collect_files(args.corpus)), tok_dir, args.vocab_size)
                tokenizer = load_tokenizer(tok_dir)
    else:
        tokenizer = load_tokenizer(args.tokenizer or args.teacher)
        teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)
        if teacher.get_input_embeddings().weight.shape[0] < len(tokenizer):
            raise SystemExit("cascade distill: the teacher's vocabulary is smaller than the tokenizer's")
    if args.init:
        init = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        if init.config.vocab_size != teacher.config.vocab_size:
            raise SystemExit(f"cascade distill: --init {args.init} has a vocabulary of {init.config.vocab_size}, "
                             f"the teacher {teacher.config.vocab_size}")
        c = init.config
        sizes = [dict(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                      intermediate=c.intermediate_size)]
        args.size = [Path(args.init).name or "init"]
    else:
        sizes = [parse_size(s) for s in args.size]
    outs = args.out or []
    if len(outs) not in (0, len(sizes)):
        raise SystemExit("cascade distill: give one --out per --size (or none)")
    names = [s.replace("/", "_") for s in args.size]
    if len(set(names)) != len(names):
        names = [f"{n}-{i}" for i, n in enumerate(names)]
    outs = outs or [str(work_dir / n) for n in names]

    files, data = load_corpus_tokens(args.corpus, tokenizer, work_dir, "train")
    log(f"corpus: {len(files)} files, {data.numel():,} tokens", work_dir)
    sampler = WindowSampler(data, args.seq_len, args.batch_size, seed=args.seed)
    students = {}
    for i, (name, size) in enumerate(zip(names, sizes)):
        if args.init:
            students[name] = init
            log(f"student {name}: initialised from {args.init}", work_dir)
            continue
        students[name] = make_model(size, tokenizer, seed=args.seed + 1 + i, max_positions=max(1024, args.seq_len))
        if teacher is not None and students[name].config.vocab_size != teacher.config.vocab_size:
            students[name].resize_token_embeddings(teacher.config.vocab_size)
        log(f"student {name}: {size} -> {count_params(students[name]):,} params", work_dir)
    lr = args.lr if args.lr is not None else (1.5e-3 if scratch else 2e-3)
    summary = train_students(
        students, teacher, sampler, args.steps, ckpt_path=work_dir / "checkpoint.pt", lr=lr,
        warmup=min(args.warmup, max(1, args.steps // 10)), min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, kl_weight=args.kl_weight,
        temperature=args.temperature, device=device, amp=use_amp(args.amp, device), checkpoint_minutes=args.checkpoint_minutes,
        checkpoint_every=args.checkpoint_every, time_budget_minutes=args.max_minutes,
        stop_after=args.stop_after, resume=_resume_mode(args), progress=not args.no_progress,
        desc="distill" if teacher is not None else "train", work_dir=work_dir,
    )
    if summary["interrupted"]:
        return 0
    windows = _eval_windows(args, tokenizer, work_dir)
    for (name, model), out, size in zip(students.items(), outs, sizes):
        extra = {"size": size, "steps": summary["steps"], "seq_len": args.seq_len, "batch_size": args.batch_size,
                 "teacher": None if scratch else str(args.teacher), "kl_weight": args.kl_weight,
                 "init": args.init, "init_training": _training_record(args.init),
                 "temperature": args.temperature, "lr": lr, "seed": args.seed,
                 "train_tokens": summary["steps"] * args.batch_size * args.seq_len,
                 "train_seconds": round(summary["train_seconds"], 1), "corpus": list(args.corpus),
                 "final_train_ce": summary["history"][name][-1][1] if summary["history"][name] else None}
        if windows is not None:
            extra["eval_loss"] = eval_loss(model, windows)
            log(f"{name}: held-out loss {extra['eval_loss']:.4f}", work_dir)
        save_model(model, tokenizer, out, dtype=args.save_dtype, extra=extra)
        log(f"saved {name} -> {out}", work_dir)
    return 0


# --------------------------------------------------------------------------- family mode


def run_family(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from cascade.train.corpus import WindowSampler, collect_files, load_tokenizer, read_texts, train_tokenizer
    from cascade.train.family import count_params, make_model, save_model

    from cascade.train.family import parse_size

    device = _setup_torch(args)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    family_dir = Path(args.family)
    sizes = {lv: dict(SIZES[lv]) for lv in LEVELS}
    for item in args.level_size:
        lv, _, spec = item.partition("=")
        if lv not in sizes or not spec:
            raise SystemExit(f"cascade distill: bad --level-size {item!r} (levels: {list(LEVELS)})")
        sizes[lv] = parse_size(spec)
    resume = _resume_mode(args)
    log(f"family build -> {family_dir} (work dir {work_dir}, device {device}, "
        f"bf16 autocast {use_amp(args.amp, device)})", work_dir)

    # 1. tokenizer
    tok_dir = work_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists() or args.restart:
        files = collect_files(args.corpus)
        log(f"training a {args.vocab_size}-token byte-level BPE on {len(files)} files", work_dir)
        train_tokenizer(read_texts(files), tok_dir, args.vocab_size)
    tokenizer = load_tokenizer(tok_dir)
    files, data = load_corpus_tokens(args.corpus, tokenizer, work_dir, "train")
    log(f"corpus: {len(files)} files, {data.numel():,} tokens", work_dir)
    windows = _eval_windows(args, tokenizer, work_dir)

    def extra_for(level, summary, lr, teacher):
        steps = summary["steps"]
        return {"level": level, "size": sizes[level], "steps": steps, "seq_len": args.seq_len,
                "batch_size": args.batch_size, "train_tokens": steps * args.batch_size * args.seq_len,
                "train_seconds": round(summary["train_seconds"], 1), "lr": lr, "seed": args.seed,
                "teacher": teacher, "kl_weight": None if teacher is None else args.kl_weight,
                "temperature": None if teacher is None else args.temperature,
                "corpus": list(args.corpus), "corpus_files": len(files), "corpus_tokens": int(data.numel()),
                "final_train_ce": summary["history"][level][-1][1] if summary["history"][level] else None}

    # 2. the large model (authority) from scratch
    large_stage = work_dir / "large"
    large_done = large_stage / "final"
    if (large_done / "config.json").exists() and not args.restart:
        log("large: already trained, loading", work_dir)
        large = AutoModelForCausalLM.from_pretrained(large_done, dtype=torch.float32)
    else:
        large = make_model(sizes["large"], tokenizer, seed=args.seed + 4, max_positions=max(1024, args.seq_len))
        log(f"large: {count_params(large):,} params, {args.teacher_steps} steps from scratch", work_dir)
        sampler = WindowSampler(data, args.seq_len, args.batch_size, seed=args.seed)
        lr = args.lr if args.lr is not None else 1.5e-3
        summary = train_students(
            {"large": large}, None, sampler, args.teacher_steps, ckpt_path=large_stage / "checkpoint.pt",
            lr=lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
            grad_clip=args.grad_clip, device=device, amp=use_amp(args.amp, device), checkpoint_minutes=args.checkpoint_minutes,
            checkpoint_every=args.checkpoint_every, time_budget_minutes=args.teacher_minutes,
            stop_after=args.stop_after, resume=resume, progress=not args.no_progress, desc="large",
            work_dir=work_dir)
        if summary["interrupted"]:
            return 0
        extra = extra_for("large", summary, lr, None)
        if windows is not None:
            extra["eval_loss"] = eval_loss(large, windows)
            log(f"large: held-out loss {extra['eval_loss']:.4f}", work_dir)
        # keep a float32 copy for distillation; publish a float16 copy
        save_model(large, tokenizer, large_done, dtype="float32", extra=extra)
        save_model(large, tokenizer, family_dir / "large", dtype=args.save_dtype, extra=extra)
        log(f"large: saved -> {family_dir / 'large'}", work_dir)
    large.to(device).eval()
    for p in large.parameters():
        p.requires_grad_(False)

    # 3. students distilled from the large model, one shared teacher forward per batch
    levels = [lv for lv in LEVELS if lv != "large"]
    todo = [lv for lv in levels if args.restart or not (family_dir / lv / "config.json").exists()
            or not (work_dir / "students" / "done").exists()]
    if todo:
        students = {lv: make_model(sizes[lv], tokenizer, seed=args.seed + 1 + i, max_positions=max(1024, args.seq_len))
                    for i, lv in enumerate(levels)}
        for lv, m in students.items():
            log(f"{lv}: {count_params(m):,} params, distilled from large for {args.student_steps} steps", work_dir)
        sampler = WindowSampler(data, args.seq_len, args.batch_size, seed=args.seed + 1)
        lr = args.lr if args.lr is not None else 2e-3
        summary = train_students(
            students, large, sampler, args.student_steps, ckpt_path=work_dir / "students" / "checkpoint.pt",
            lr=lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
            grad_clip=args.grad_clip, kl_weight=args.kl_weight, temperature=args.temperature, device=device,
            amp=use_amp(args.amp, device),
            checkpoint_minutes=args.checkpoint_minutes, checkpoint_every=args.checkpoint_every,
            time_budget_minutes=args.student_minutes, stop_after=args.stop_after, resume=resume,
            progress=not args.no_progress, desc="students", work_dir=work_dir)
        if summary["interrupted"]:
            return 0
        for lv, m in students.items():
            extra = extra_for(lv, summary, lr, "large")
            if windows is not None:
                extra["eval_loss"] = eval_loss(m, windows)
                log(f"{lv}: held-out loss {extra['eval_loss']:.4f}", work_dir)
            save_model(m, tokenizer, family_dir / lv, dtype=args.save_dtype, extra=extra)
            log(f"{lv}: saved -> {family_dir / lv}", work_dir)
        (work_dir / "students" / "done").write_text("ok\n")

    # 4. optional: refine the large model against the ensemble of the distilled medium and small
    refine_dir = work_dir / "refine"
    if args.refine_steps > 0 and (args.restart or not (refine_dir / "done").exists()):
        members = [AutoModelForCausalLM.from_pretrained(family_dir / lv, dtype=torch.float32).to(device).eval()
                   for lv in ("medium", "small")]
        teacher = EnsembleTeacher(members)
        sampler = WindowSampler(data, args.seq_len, args.batch_size, seed=args.seed + 2)
        for p in large.parameters():
            p.requires_grad_(True)
        log(f"large: refining against the ensemble of medium+small for {args.refine_steps} steps", work_dir)
        summary = train_students(
            {"large": large}, teacher, sampler, args.refine_steps, ckpt_path=refine_dir / "checkpoint.pt",
            lr=args.refine_lr, warmup=min(args.warmup, 20), min_lr_ratio=args.min_lr_ratio,
            weight_decay=args.weight_decay, grad_clip=args.grad_clip, kl_weight=args.refine_kl_weight,
            temperature=1.0, device=device, amp=use_amp(args.amp, device),
            checkpoint_minutes=args.checkpoint_minutes, checkpoint_every=args.checkpoint_every,
            time_budget_minutes=args.refine_minutes, stop_after=args.stop_after, resume=resume,
            progress=not args.no_progress, desc="refine", work_dir=work_dir)
        if summary["interrupted"]:
            return 0
        info = json.loads((large_done / "training.json").read_text())
        info["refine"] = {"teacher": "ensemble(medium, small)", "steps": summary["steps"],
                          "train_tokens": summary["steps"] * args.batch_size * args.seq_len,
                          "train_seconds": round(summary["train_seconds"], 1), "lr": args.refine_lr,
                          "kl_weight": args.refine_kl_weight}
        info["train_tokens"] += info["refine"]["train_tokens"]
        info["train_seconds"] = round(info["train_seconds"] + info["refine"]["train_seconds"], 1)
        if windows is not None:
            info["eval_loss"] = eval_loss(large, windows)
            log(f"large (refined): held-out loss {info['eval_loss']:.4f}", work_dir)
        save_model(large, tokenizer, family_dir / "large", dtype=args.save_dtype, extra=info)
        save_model(large, tokenizer, refine_dir / "final", dtype="float32", extra=info)
        (refine_dir / "done").write_text("ok\n")
        log(f"large (refined): saved -> {family_dir / 'large'}", work_dir)
    log("family build complete", work_dir)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="cascade")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
