"""Is the rebuild on track? Probe a training checkpoint of the family rebuild (issue 18) against
the targets the model card will check, without stopping the training.

    python examples/models/probe_checkpoint.py                       # large's checkpoint
    python examples/models/probe_checkpoint.py --stage students      # the students' checkpoint
    python examples/models/probe_checkpoint.py --baseline examples/models   # and the bundled family

Prints, per model: the step, the held-out loss (the model card's held-out text, code from
packages outside the corpus) in nats per token and, comparable across tokenizers, nats per
character, the median repeated-4-gram share of greedy continuations of the held-out prompts, and
how many of those continuations start at column 0 (every held-out prompt ends inside an indented
docstring or body, on a newline: a model that starts at column 0 has lost the indentation, as
GPT-2's pre-tokenizer made the first rebuild do). It reads the checkpoint once (a consistent copy: the
trainer replaces the file atomically) and runs on one thread, so a niced training keeps going.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from cascade.repetition import median_repetition  # noqa: E402
from cascade.train.family import SIZES, make_model  # noqa: E402
from cascade.train.family_eval import (  # noqa: E402
    greedy_continuations, heldout_losses, heldout_windows, nats_per_char)
from cascade.train.heldout import heldout_text, load_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def checkpoint_models(work: Path, stage: str, tokenizer) -> tuple[int, dict]:
    state = torch.load(work / stage / "checkpoint.pt", map_location="cpu", weights_only=False)
    models = {}
    for name, saved in state["students"].items():
        model = make_model(SIZES[name], tokenizer, seed=0)
        model.load_state_dict(saved["model"])
        models[name] = model.float().eval()
    return state["step"], models


def bundled_models(family: Path, levels) -> dict:
    from transformers import AutoModelForCausalLM

    return {f"bundled {lv}": AutoModelForCausalLM.from_pretrained(family / lv, dtype=torch.float32).eval()
            for lv in levels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rebuild-dir", default=os.environ.get("REBUILD_DIR", "/work/family-rebuild"))
    ap.add_argument("--stage", default="large", choices=["large", "students"])
    ap.add_argument("--baseline", help="a family directory to measure beside it (its tokenizer may differ)")
    ap.add_argument("--windows", type=int, default=32, help="held-out windows of 256 tokens")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for the greedy repetition")
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the whole held-out text is tokenized at once, on purpose
    work = Path(args.rebuild_dir) / "work"
    tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
    step, models = checkpoint_models(work, args.stage, tokenizer)
    rows = {name: (tokenizer, model) for name, model in models.items()}
    if args.baseline:
        btok = AutoTokenizer.from_pretrained(Path(args.baseline) / "large")
        levels = ["large"] if args.stage == "large" else ["tiny", "small", "medium", "large"]
        rows.update({n: (btok, m) for n, m in bundled_models(Path(args.baseline), levels).items()})
    text = heldout_text()
    prompts = load_prompts(ROOT / "examples" / "prompts" / "heldout.jsonl")[: args.prompts]
    out = {"stage": args.stage, "step": step, "models": {}}
    for name, (tok, model) in rows.items():
        windows = heldout_windows(tok, seq_len=256, n=args.windows, text=text)
        loss = heldout_losses({name: model}, windows)[name]
        per_char = nats_per_char(loss, tok, windows)
        gens = greedy_continuations(model, tok, prompts, new_tokens=args.new_tokens)
        rep = median_repetition([g.tolist() for _, g in gens])
        column0 = sum(tok.decode(g[:6]).lstrip("\r\n")[:1] not in (" ", "\t") for _, g in gens)
        out["models"][name] = {"heldout_loss": round(loss, 4), "heldout_nats_per_char": round(per_char, 4),
                               "greedy_repetition_median": round(rep, 3), "column0_starts": column0}
        print(f"{name:>16}  step {step if not name.startswith('bundled') else '-':>6}  held-out loss {loss:.4f}/token"
              f" {per_char:.4f}/char  greedy repeated-4-gram share (median) {rep:.3f}"
              f"  column-0 starts {column0}/{len(gens)}", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
