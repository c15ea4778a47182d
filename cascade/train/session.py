"""What every mode of ``cascade distill`` sets up the same way from its arguments: torch (threads,
seed, device), the optimisation and the checkpointed session, and the run's record for
training.json. Shared by the drafters' modes (:mod:`cascade.train.distill`) and the feature
head's (:mod:`cascade.train.head`)."""
from __future__ import annotations

from pathlib import Path

from cascade.train.trainer import Optimisation, Session


def use_amp(name: str, device) -> bool:
    """Whether to train under bfloat16 autocast (see --amp)."""
    import torch

    if name == "none":
        return False
    if name == "bf16":
        return True
    from workers.devices import native_bf16

    return native_bf16(device)


def setup_torch(args):
    """Threads and seed; the device, where an unavailable one asked for by name is an error (hours
    of training on a device other than the one named is worse than stopping)."""
    import torch

    from workers.devices import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        return resolve_device(args.device, fallback=False)
    except ValueError as exc:
        raise SystemExit(f"cascade distill: --device: {exc}") from exc


def optimisation(args, device, lr: float, warmup: int, kl_weight: float | None = None,
                  temperature: float | None = None) -> Optimisation:
    return Optimisation(
        lr=lr, warmup=warmup, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, kl_weight=args.kl_weight if kl_weight is None else kl_weight,
        temperature=args.temperature if temperature is None else temperature, amp=use_amp(args.amp, device),
        unlikelihood_every=args.unlikelihood_every, rollout_prefix=args.rollout_prefix,
        rollout_tokens=args.rollout_tokens)


def session(args, ckpt_path: Path, minutes: float | None, desc: str) -> Session:
    return Session(
        ckpt_path=ckpt_path, checkpoint_minutes=args.checkpoint_minutes, checkpoint_every=args.checkpoint_every,
        time_budget_minutes=minutes, stop_after=args.stop_after, resume=resume_mode(args),
        progress=not args.no_progress, desc=desc, work_dir=Path(args.work_dir))


def resume_mode(args) -> str:
    return "require" if args.resume else ("never" if args.restart else "auto")


def run_record(args, device) -> dict:
    """Where and how a model was trained, for its training.json."""
    import torch

    return {"device": device_name(device), "bf16_autocast": use_amp(args.amp, device), "threads": args.threads,
            "torch": torch.__version__}


def device_name(device) -> str:
    """The training device in words (``cpu``, or ``cuda: NVIDIA H200``) for training.json."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return device.type
