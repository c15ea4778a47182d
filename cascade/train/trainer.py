"""The training loop of ``cascade distill``: students trained against a teacher (or from scratch),
checkpointed atomically and resumable to the step.

A stage is ``train_students(students, teacher, sampler, steps, Optimisation(...), Session(...))``:
``Optimisation`` says how it learns (schedule, loss), ``Session`` when it checkpoints, stops and
reports. Batches are a pure function of the sampler's seed and the step index, so a resumed run
trains on exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Optimisation:
    """How a stage learns: AdamW under a warm-up + cosine schedule, and the loss.

    With a teacher the loss is ``kl_weight * T^2 * KL(p_teacher^T || p_student^T) +
    (1 - kl_weight) * CE`` (``T`` = ``temperature``); without one it is plain cross-entropy.
    ``amp``: forwards under bfloat16 autocast.

    ``unlikelihood_every`` = K > 0 makes every K-th step a sequence-level unlikelihood step
    (:mod:`cascade.train.unlikelihood`) instead: each student writes greedy continuations of
    ``rollout_tokens`` tokens from the batch rows' first ``rollout_prefix`` tokens and is trained
    away from the tokens of their repeated 4-grams.
    """

    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    kl_weight: float = 0.8
    temperature: float = 1.0
    amp: bool = False
    unlikelihood_every: int = 0
    rollout_prefix: int = 48
    rollout_tokens: int = 96

    def unlikelihood_step(self, step: int) -> bool:
        return self.unlikelihood_every > 0 and step % self.unlikelihood_every == self.unlikelihood_every - 1

    def unlikelihood_steps(self, steps: int) -> int:
        """How many of steps 0..steps-1 are unlikelihood steps."""
        return steps // self.unlikelihood_every if self.unlikelihood_every > 0 else 0


@dataclass(frozen=True)
class Session:
    """When a stage checkpoints, stops and reports.

    ``resume``: ``"auto"`` (resume if a checkpoint exists), ``"require"`` or ``"never"``.
    ``time_budget_minutes``: stop once that much training time (summed over resumed sessions)
    has passed; the cosine schedule then follows whichever of step- or time-progress is further
    along. ``stop_after``: checkpoint and return (``interrupted``) after that many steps in this
    session.
    """

    ckpt_path: Path
    checkpoint_minutes: float = 3.0
    checkpoint_every: int | None = None
    time_budget_minutes: float | None = None
    stop_after: int | None = None
    resume: str = "auto"
    progress: bool = True
    desc: str = "train"
    work_dir: Path | None = None


def log(msg: str, work_dir: Path | None = None) -> None:
    """Print a timestamped line, and append it to ``work_dir/distill.log``."""
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


# --------------------------------------------------------------------------- the loop


def train_students(students: dict, teacher, sampler, steps: int, opt: Optimisation, session: Session,
                   device=None, step_fn=None) -> dict:
    """Train every model in ``students`` (name -> causal LM) for ``steps`` steps on
    ``sampler.batch(step)``; the teacher's forward (if any) is computed once per batch and shared.
    ``step_fn(students, optims, batch, lr, opt, running, device)``, if given, makes each step
    instead (a loss of its own: :mod:`cascade.train.head`) and returns the progress postfix.

    Returns ``{"steps": steps done, "history": {name: [(step, running CE)]}, "interrupted":
    stopped by ``stop_after`` or SIGTERM, "train_seconds": summed over resumed sessions}``.
    """
    import torch
    from tqdm.auto import tqdm

    device = device or torch.device("cpu")
    ckpt = _Checkpoint(session, students, _optimizers(students, opt, device), steps)
    if teacher is not None:
        teacher.to(device).eval()
    start = ckpt.resume(device)
    clock = _Clock(ckpt.elapsed_before, session.time_budget_minutes)
    bar = tqdm(total=steps, initial=start, desc=session.desc, disable=not session.progress,
               dynamic_ncols=True, mininterval=2.0)
    running = {n: None for n in students}
    tokens, done, last_ckpt = 0, start, time.time()
    with _TermSignal() as term:
        for step in range(start, steps):
            if _out_of_time(step, steps, clock, session):
                break
            if _stop_now(step, start, steps, session, term):
                ckpt.save(step, clock.elapsed())
                return _summary(step, ckpt.history, clock, interrupted=True)
            lr = lr_at(step, steps, opt.lr, opt.warmup, opt.min_lr_ratio, clock.progress(step, steps, opt.warmup))
            batch = sampler.batch(step).to(device)
            if step_fn is not None:
                post = step_fn(students, ckpt.optims, batch, lr, opt, running, device)
                tokens += batch.input_tokens()
            elif opt.unlikelihood_step(step):
                post = _unlikelihood_step(students, ckpt.optims, batch, lr, opt, running, device)
            else:
                post = _train_step(students, ckpt.optims, teacher, batch, lr, opt, running, device)
                tokens += batch.input_tokens() if hasattr(batch, "input_tokens") else batch[:, :-1].numel()
            done = step + 1
            bar.update(1)
            bar.set_postfix(post, refresh=False)
            if done % 50 == 0 or done == steps:
                _report(done, steps, lr, post, running, ckpt.history, tokens / max(1e-9, clock.session()), session)
            if done < steps and ckpt.due(done, last_ckpt):
                ckpt.save(done, clock.elapsed())
                last_ckpt = time.time()
    bar.close()
    if done > start or not session.ckpt_path.exists():
        ckpt.save(done, clock.elapsed())
    for model in students.values():
        model.eval()
    return _summary(done, ckpt.history, clock, interrupted=False)


def _train_step(students: dict, optims: dict, teacher, batch, lr: float, opt: Optimisation,
                running: dict, device) -> dict[str, str]:
    """One optimizer step of every student on ``batch`` [batch, seq_len + 1]; updates the running
    CE per student and returns the progress-bar postfix. A recorded batch
    (:class:`cascade.train.records.RecordBatch`) carries its teacher: the loss is the KL to it."""
    if hasattr(batch, "topk_ids"):
        return _record_step(students, optims, batch, lr, opt, running, device)
    x, y = batch[:, :-1], batch[:, 1:]
    teacher_logp = None if teacher is None else _teacher_log_probs(teacher, x, opt, device)
    post = {}
    for name, model in students.items():
        ce, kl = _student_step(model, optims[name], x, y, teacher_logp, lr, opt, device)
        val = ce.item()
        running[name] = val if running[name] is None else 0.95 * running[name] + 0.05 * val
        post[name] = f"{running[name]:.3f}" + (f"/kl{kl.item():.3f}" if kl is not None else "")
    return post


def _record_step(students: dict, optims: dict, batch, lr: float, opt: Optimisation, running: dict,
                 device) -> dict[str, str]:
    """One step of every student against the teacher's recorded top-k (the running figure is the
    KL; the postfix adds the top-1 agreement)."""
    import torch

    from cascade.train.records import record_loss

    post = {}
    for name, model in students.items():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opt.amp):
            logits = model(input_ids=batch.x).logits
        kl, top1 = record_loss(logits.float(), batch)
        _optimizer_step(model, optims[name], kl, lr, opt)
        val = kl.item()
        running[name] = val if running[name] is None else 0.95 * running[name] + 0.05 * val
        post[name] = f"kl{running[name]:.3f}/top1 {top1.item():.2f}"
    return post


def _unlikelihood_step(students: dict, optims: dict, batch, lr: float, opt: Optimisation, running: dict,
                       device) -> dict[str, str]:
    """One sequence-level unlikelihood step of every student (:mod:`cascade.train.unlikelihood`) on
    its own greedy continuations of the rows of ``batch``; the postfix shows the share of their
    tokens inside repeated 4-grams."""
    import torch

    from cascade.train.unlikelihood import rollout_batch, unlikelihood_loss

    post = {}
    for name, model in students.items():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opt.amp):
            x, targets, negative, share = rollout_batch(model, batch, opt.rollout_prefix, opt.rollout_tokens)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opt.amp):
            logits = model(input_ids=x).logits[:, opt.rollout_prefix - 1:]
        _optimizer_step(model, optims[name], unlikelihood_loss(logits.float(), targets, negative.to(device)), lr, opt)
        key = f"{name}_loop"
        running[key] = share if running.get(key) is None else 0.9 * running[key] + 0.1 * share
        post[name] = f"{running[name]:.3f}" if running.get(name) is not None else "-"
        post[name] += f"/loop{running[key]:.2f}"
    return post


def _teacher_log_probs(teacher, x, opt: Optimisation, device):
    """The teacher's log-probabilities at temperature T, [batch, seq_len, vocab]."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=opt.amp):
        logits = teacher(input_ids=x).logits.float()
        return F.log_softmax(logits / opt.temperature, dim=-1)


def _student_step(model, optim, x, y, teacher_logp, lr: float, opt: Optimisation, device):
    """Forward, loss, backward, clipped AdamW step; returns (CE, KL or None) as tensors."""
    import torch

    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opt.amp):
        logits = model(input_ids=x).logits
    loss, ce, kl = distill_loss(logits.float(), y, teacher_logp, opt.kl_weight, opt.temperature)
    _optimizer_step(model, optim, loss, lr, opt)
    return ce, kl


def _optimizer_step(model, optim, loss, lr: float, opt: Optimisation) -> None:
    """Backward ``loss``, clip the gradient, one AdamW step at ``lr``."""
    import torch

    for group in optim.param_groups:
        group["lr"] = lr
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
    optim.step()
    optim.zero_grad(set_to_none=True)


def distill_loss(logits, targets, teacher_logp, kl_weight: float, temperature: float):
    """(loss, CE, KL) of student ``logits`` [batch, seq, vocab] (float32) against the next tokens
    ``targets`` [batch, seq] and, if given, the teacher's ``teacher_logp`` at temperature T
    [batch, seq, vocab]; KL is None without a teacher and the loss is then the CE."""
    import torch.nn.functional as F

    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    if teacher_logp is None:
        return ce, ce, None
    student_logp = F.log_softmax(logits / temperature, dim=-1)
    kl = F.kl_div(student_logp, teacher_logp, log_target=True, reduction="none").sum(-1).mean()
    return kl_weight * temperature**2 * kl + (1 - kl_weight) * ce, ce, kl


def _optimizers(students: dict, opt: Optimisation, device) -> dict:
    """AdamW per student; no weight decay on vectors (norms, biases)."""
    import torch

    optims = {}
    for name, model in students.items():
        model.to(device).train()
        decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for _, p in model.named_parameters() if p.ndim < 2]
        optims[name] = torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=opt.lr, betas=(0.9, 0.95), eps=1e-8,
        )
    return optims


def _stop_now(step: int, start: int, steps: int, session: Session, term: "_TermSignal") -> bool:
    """Whether to checkpoint and return before ``step``: --stop-after reached, or SIGTERM."""
    if term.received:
        log(f"{session.desc}: SIGTERM, stopping at step {step}/{steps}; re-run to resume", session.work_dir)
        return True
    if session.stop_after is not None and step - start >= session.stop_after:
        log(f"{session.desc}: stopping after {session.stop_after} steps this session (at step "
            f"{step}/{steps}); re-run to resume", session.work_dir)
        return True
    return False


class _TermSignal:
    """SIGTERM (``kill``, a session ending) stops training at the next step with a checkpoint,
    instead of losing the steps since the last one. Only where handlers can be set (the main
    thread); on exit the previous handler is back."""

    received = False
    _previous = None

    def __enter__(self) -> "_TermSignal":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _out_of_time(step: int, steps: int, clock: "_Clock", session: Session) -> bool:
    if clock.budget_s is None or clock.elapsed() < clock.budget_s:
        return False
    log(f"{session.desc}: time budget of {session.time_budget_minutes} min reached at step {step}/{steps}",
        session.work_dir)
    return True


def _report(done: int, steps: int, lr: float, post: dict, running: dict, history: dict, tok_s: float,
            session: Session) -> None:
    for name in history:
        history[name].append((done, running[name]))
    log(f"{session.desc}: step {done}/{steps} lr {lr:.2e} " + " ".join(f"{n}={v}" for n, v in post.items())
        + f" tok/s {tok_s:.0f}", session.work_dir)


def _summary(steps: int, history: dict, clock: "_Clock", interrupted: bool) -> dict:
    return {"steps": steps, "history": history, "interrupted": interrupted, "train_seconds": clock.elapsed()}


class _Clock:
    """Training time: this session's wall time plus what earlier sessions recorded."""

    def __init__(self, elapsed_before: float, budget_minutes: float | None):
        self.elapsed_before = elapsed_before
        self.budget_s = budget_minutes * 60 if budget_minutes else None
        self.t_start = time.time()

    def session(self) -> float:
        return time.time() - self.t_start

    def elapsed(self) -> float:
        return self.elapsed_before + time.time() - self.t_start

    def progress(self, step: int, steps: int, warmup: int) -> float | None:
        """Cosine progress for a time-budgeted run (None: follow the steps)."""
        if self.budget_s is None:
            return None
        return max((step - warmup) / max(1, steps - warmup), self.elapsed() / self.budget_s)


class _Checkpoint:
    """A stage's state on disk: weights and optimizer state per student, the step, the running
    losses and the training time so far; written atomically (a crash never leaves half a file)."""

    def __init__(self, session: Session, students: dict, optims: dict, steps: int):
        self.session, self.students, self.optims, self.steps = session, students, optims, steps
        self.history = {n: [] for n in students}
        self.elapsed_before = 0.0

    def resume(self, device) -> int:
        """Load the checkpoint if the session says so; the step to start at."""
        import torch

        path, session = self.session.ckpt_path, self.session
        if session.resume == "never" or not path.exists():
            if session.resume == "require":
                raise SystemExit(f"cascade distill: --resume given but no checkpoint at {path}")
            return 0
        state = torch.load(path, map_location=device, weights_only=False)
        if set(state["students"]) != set(self.students):
            raise SystemExit(f"checkpoint {path} holds {sorted(state['students'])}, "
                             f"not {sorted(self.students)}; use --restart or another --work-dir")
        for name, model in self.students.items():
            model.load_state_dict(state["students"][name]["model"])
            self.optims[name].load_state_dict(state["students"][name]["optim"])
        self.history = state.get("history", self.history)
        self.elapsed_before = state.get("elapsed", 0.0)
        log(f"{session.desc}: resumed from {path} at step {state['step']}/{self.steps}", session.work_dir)
        return state["step"]

    def due(self, done: int, last_save: float) -> bool:
        every = self.session.checkpoint_every
        return ((time.time() - last_save) >= self.session.checkpoint_minutes * 60
                or bool(every and done % every == 0))

    def save(self, step: int, elapsed: float) -> None:
        import torch

        path = self.session.ckpt_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save({
            "step": step,
            "total_steps": self.steps,
            "students": {n: {"model": m.state_dict(), "optim": self.optims[n].state_dict()}
                         for n, m in self.students.items()},
            "history": self.history,
            "elapsed": elapsed,
        }, tmp)
        os.replace(tmp, path)


# --------------------------------------------------------------------------- teachers and evaluation


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
