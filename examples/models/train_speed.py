"""Training throughput of the family's shapes on this machine, float32 against bfloat16 autocast.

Runs the real training loop (``cascade.train.trainer.train_students``) for a few steps on random
tokens and reports tokens/s after a warm-up, per level and precision::

    OMP_NUM_THREADS=1 nice -n 19 python examples/models/train_speed.py --levels large --steps 12

``--teacher large`` times a distillation step instead (the students share one teacher forward).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from cascade.train.family import make_config, parse_size
from cascade.train.trainer import Optimisation, Session, train_students


class _RandomTokens:
    def __init__(self, vocab: int, seq_len: int, batch_size: int):
        self.vocab, self.seq_len, self.batch_size = vocab, seq_len, batch_size

    def batch(self, step: int):
        g = torch.Generator().manual_seed(step)
        return torch.randint(1, self.vocab, (self.batch_size, self.seq_len + 1), generator=g)


def _model(size: dict, vocab: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(make_config(size, _Vocab(vocab)))


class _Vocab:
    """Just enough of a tokenizer for make_config."""

    bos_token_id = eos_token_id = pad_token_id = 0

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def tokens_per_second(students: dict, teacher, amp: bool, steps: int, warmup_steps: int,
                      seq_len: int, batch_size: int, vocab: int) -> tuple[float, float]:
    """(tokens per wall second, tokens per CPU second of this process). On a machine shared with
    other jobs the second is the one to compare: it does not count the time others ran."""
    sampler = _RandomTokens(vocab, seq_len, batch_size)
    opt = Optimisation(lr=1e-4, warmup=1, amp=amp)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "c.pt"
        # warm-up steps are not timed (allocator, oneDNN kernel selection)
        train_students(students, teacher, sampler, warmup_steps, opt,
                       Session(ckpt, checkpoint_minutes=1e9, resume="never", progress=False))
        t0, c0 = time.perf_counter(), time.process_time()
        train_students(students, teacher, sampler, warmup_steps + steps, opt,
                       Session(ckpt, checkpoint_minutes=1e9, resume="auto", progress=False))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = steps * seq_len * batch_size
    return tokens / wall, tokens / cpu


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", nargs="+", default=["large"], help="presets or LAYERSxHIDDEN[xHEADS[xFFN]]")
    p.add_argument("--teacher", default=None, help="time distillation from this shape (one step trains all --levels)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = p.parse_args()
    rows = []
    for precision in args.precisions:
        amp = precision == "bf16"
        if args.teacher:
            teacher = _model(parse_size(args.teacher), args.vocab).eval()
            students = {lv: _model(parse_size(lv), args.vocab) for lv in args.levels}
            groups = [("+".join(args.levels) + f" <- {args.teacher}", students, teacher)]
        else:
            groups = [(lv, {lv: _model(parse_size(lv), args.vocab)}, None) for lv in args.levels]
        for name, students, teacher in groups:
            wall, cpu = tokens_per_second(students, teacher, amp, args.steps, args.warmup_steps,
                                          args.seq_len, args.batch_size, args.vocab)
            rows.append({"what": name, "precision": precision, "tokens_per_wall_s": round(wall, 1),
                         "tokens_per_cpu_s": round(cpu, 1), "threads": torch.get_num_threads()})
            print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
