"""``cascade pipeline``: the drafters' whole pipeline in one command, for a machine with an
accelerator (or, at toy size, any machine): record the authority's conversations, train a feature
head and a drafter on them, write everything to one folder.

    cascade pipeline --model pulled:smollm2-135m-instruct --out runs/gpu --device auto \\
        --sequences 20000 --batch 256 --head-minutes 20 --drafter-minutes 20

``OUT/record`` holds the shards (``OUT/ids`` their token ids, compressed: commit those to keep
the data), ``OUT/head`` the head (``--init HEAD`` continues one), ``OUT/draft`` the drafter; each
stage is the ordinary command (``cascade record``, ``cascade distill --head``, ``cascade distill
--records``), run with the same device, so a stopped pipeline resumes stage by stage.
"""
from __future__ import annotations

from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="record, then train a feature head and a drafter, into one folder",
                       description=__doc__.split("\n\n")[0].replace("``", "'"))
    p.add_argument("--model", required=True, help="the authority: a model folder or pulled:NAME")
    p.add_argument("--out", required=True, help="folder for everything the pipeline writes")
    p.add_argument("--device", default="auto", help="cpu, auto (CUDA where present) or cuda")
    p.add_argument("--sequences", type=int, default=4096, help="conversations to record")
    p.add_argument("--batch", type=int, default=64, help="conversations per shard, generated together")
    p.add_argument("--keep", help="where the token ids go (default OUT/ids); shards found there are only scored")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the head's and the drafter's draft vocabulary")
    p.add_argument("--init", metavar="HEAD", help="continue this head instead of a new one")
    p.add_argument("--head-minutes", type=float, default=20.0)
    p.add_argument("--drafter-size", default="2x256", help="the drafter's shape (0: no drafter)")
    p.add_argument("--drafter-minutes", type=float, default=20.0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="training windows per step")
    p.add_argument("--answer-tokens", type=int, default=256, help="longest answer recorded")
    p.add_argument("--user-tokens", type=int, default=64, help="longest user turn recorded")
    p.add_argument("--corpus", default="manifest:examples/models/CORPUS.tsv", help="code snippets for questions")
    p.add_argument("--dtype", default="measured", choices=("measured", "fastest", "float32", "bfloat16"),
                   help="the recording authority's dtype, as `cascade record --dtype` (measured: on a CPU the faster "
                        "of float32 and bfloat16 at each pass's width; off the CPU as fastest)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from cascade.cli import main

    out = Path(args.out)
    device = "cuda" if args.device.startswith("cuda") else args.device
    common = ["--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--device", device,
              "--threads", str(args.threads), "--amp", "auto", "--steps", "1000000", "--no-progress",
              "--save-dtype", "bfloat16"]
    stages = [
        ["record", "--model", args.model, "--out", str(out / "record"), "--keep", args.keep or str(out / "ids"),
         "--sequences", str(args.sequences), "--batch", str(args.batch), "--device", args.device,
         "--dtype", args.dtype, "--threads", str(args.threads), "--answer-tokens", str(args.answer_tokens),
         "--user-tokens", str(args.user_tokens), "--corpus", args.corpus],
        ["distill", "--head", "--records", str(out / "record"), "--out", str(out / "head"),
         "--work-dir", str(out / "head-train"), "--max-minutes", str(args.head_minutes),
         *(["--init", args.init] if args.init else ["--draft-vocab", str(args.draft_vocab)]), *common],
    ]
    if args.drafter_size != "0":
        stages.append(["distill", "--records", str(out / "record"), "--draft-vocab", str(args.draft_vocab),
                       "--size", args.drafter_size, "--out", str(out / "draft"), "--work-dir", str(out / "draft-train"),
                       "--max-minutes", str(args.drafter_minutes), *common])
    for stage in stages:
        print(f"cascade pipeline: cascade {' '.join(stage)}", flush=True)
        code = main(stage)
        if code:
            return code
    print(f"cascade pipeline: done -> {out}", flush=True)
    return 0
