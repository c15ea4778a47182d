"""Score drafters and feature heads on the held-out shards of recorded conversations, side by side
(what `cascade distill` reports at the end of a run, for folders trained on other records too).

    python examples/models/smollm2/eval_heldout.py examples/models/smollm2/draft-s other/draft-s
    python examples/models/smollm2/eval_heldout.py --head examples/models/smollm2/head other/head
    python examples/models/smollm2/eval_heldout.py --head --fixed examples/models/smollm2/head

--fixed scores on the repository's own held-out conversations (``heldout/``: token ids that
`cascade record --keep` wrote with a seed no training run uses), rebuilt under the work folder
(scored by the authority, features computed) on first use: the same set for every checkpoint,
on any machine. Heads are then also drafted at T = 0.8 (sampled chains, each drafted token counted
``min(1, target/draft)``) beside greedy.

Drafters: held-out KL to the recorded top-16, top-1 agreement, expected acceptance of one drafted
token at T = 1 (cascade.train.records.evaluate). Heads (--head): the same on the cached features,
and greedy drafting from their own predicted features at 256 starts in the answers, depth 3
(cascade.train.head.draft_acceptance). Every folder is scored on the same shards, so a folder
trained on fewer records is scored on shards it never saw.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

WORK = Path(os.environ.get("SMOLLM2_WORK", Path.home() / ".cache/cascade/work/smollm2"))


def rounded(d: dict) -> dict:
    r = lambda v: round(v, 4) if isinstance(v, float) else [r(x) for x in v] if isinstance(v, list) else v  # noqa: E731
    return {k: r(v) for k, v in d.items()}


def drafters(folders: list[str], records: Path) -> None:
    from transformers import AutoModelForCausalLM
    from cascade.train.records import RecordSampler, evaluate, load_records
    from workers.draft_vocab import DraftVocab

    held = load_records(records, held_out=True)
    print(f"held out: {held.tokens.numel():,} tokens", flush=True)
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        sampler = RecordSampler(held, DraftVocab.load(folder), 256, 8)
        print(folder, rounded(evaluate(model, sampler)), flush=True)


HELDOUT = Path(__file__).parent / "heldout"


def fixed_heldout(work: Path, authority: str) -> Path:
    """The repository's held-out conversations as record shards (top-k and features), under ``work``."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from cascade.cli import main as cascade
    from cascade.pull import PULLED, resolve_pulled
    from cascade.train.head import cache_features
    from workers.devices import resolve_dtype

    kept = sorted(HELDOUT.glob("shard-*.npz"))
    batch = len(np.load(kept[0])["lengths"])
    assert cascade(["record", "--model", authority, "--out", str(work), "--keep", str(HELDOUT),
                    "--sequences", str(batch * len(kept)), "--batch", str(batch),
                    "--dtype", "fastest"]) == 0  # scored as the features are: every checkpoint the same way
    path = str(resolve_pulled(authority)) if authority.startswith(PULLED) else authority
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype("fastest", torch.device("cpu"))).eval()
    cache_features(work, work / "features", model, authority)
    return work


def fused_heldout(records: Path, model, authority: str, head, every: int):
    """The held-out shards with the features a head that fuses layers reads (EAGLE-3,
    cascade/train/head_eagle3.py), computed once into a folder of this script's own under WORK
    (never into the records' folder)."""
    from cascade.train.head import cache_features, load_head_data
    from cascade.train.records import record_shards

    layers = head.config.fuse_layers
    out = WORK / "fused-features" / f"{records.name}-layers-{'-'.join(map(str, layers))}"
    cache_features(records, out, model, authority, layers=layers, shards=record_shards(records, True, every))
    return load_head_data(records, out, held_out=True, held_out_every=every, layers=layers)


def heads(folders: list[str], records: Path, authority: str, every: int = 20, temperatures=(0.0,),
          seed: int = 0) -> None:
    from transformers import AutoModelForCausalLM
    from cascade.pull import PULLED, resolve_pulled
    from cascade.train.corpus import load_tokenizer
    from cascade.train.head import (HeadObjective, HeadSampler, answer_starts, draft_acceptance, evaluate_head,
                                    generation_prompt, load_head_data)
    from workers.draft_vocab import DraftVocab
    from workers.head import FeatureHead

    path = str(resolve_pulled(authority)) if authority.startswith(PULLED) else authority
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    held = load_head_data(records, records / "features", held_out=True, held_out_every=every)
    answers = answer_starts(held, generation_prompt(load_tokenizer(path)))
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    for folder in folders:
        vocab = DraftVocab.load(folder)
        rms = json.loads((Path(folder) / "training.json").read_text())["feature_rms"]
        ids = None if vocab is None else torch.as_tensor(vocab.ids)
        objective = HeadObjective(embed, lm_head, ids, "cpu", feature_rms=rms)
        head = FeatureHead.from_pretrained(folder, dtype=torch.float32).eval()
        data = held if not head.config.fuse_layers else fused_heldout(records, model, authority, head, every)
        print(folder, rounded(evaluate_head(head, objective, HeadSampler(data, 256, 8))), flush=True)
        for t in temperatures:
            drafting = draft_acceptance(head, objective, model, data, starts=256, answers=answers, temperature=t,
                                        seed=seed)
            print(folder, f"drafting in the answers, T = {t}", json.dumps(rounded(drafting)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--head", action="store_true", help="the folders are feature heads")
    ap.add_argument("--records", type=Path, default=WORK / "record", help="what cascade record wrote")
    ap.add_argument("--authority", default="pulled:smollm2-135m-instruct")
    ap.add_argument("--fixed", action="store_true", help="score on the repository's held-out set (heldout/)")
    ap.add_argument("--seed", type=int, default=0, help="which 256 starts (and, at T = 0.8, which draws)")
    args = ap.parse_args()
    if args.fixed:
        records = fixed_heldout(WORK / "heldout", args.authority)
        if not args.head:
            print("--fixed scores heads (--head)")
            return
        heads(args.folders, records, args.authority, every=1, temperatures=(0.0, 0.8), seed=args.seed)
    elif args.head:
        heads(args.folders, args.records, args.authority, seed=args.seed)
    else:
        drafters(args.folders, args.records)


if __name__ == "__main__":
    main()
