"""``cascade run``: a batch of prompts from JSONL to results in JSONL, locally or as a Ray job.

    cascade run --topology T --prompts in.jsonl --output out.jsonl [--max-new-tokens N ...]
    ray job submit --working-dir . -- cascade run --backend ray --topology T ...

Input: one JSON object per line with a ``prompt`` field. Output: one line per prompt, in input
order, ``Generation.to_dict()`` (text, token ids, finish reason, statistics) plus ``line``, the
prompt's line number in the input. Prompt ``i`` uses ``seed + i``, as ``Cascade.generate`` does
for a list. Inside a Ray job ``RAY_ADDRESS`` is set, so ``--backend ray`` places the level
actors on that cluster.

Work is never lost:

- The output may not be the input, and an existing non-empty output is refused unless
  ``--resume`` (keep its results, run only the prompts it lacks) or ``--overwrite``.
- A prompt that fails (too long for the context, a token the model cannot take, the authority
  down) gets an error line ``{"line", "prompt", "error"}`` (plus ``partial``, what was committed,
  when a worker failed) and one line on stderr; the job goes on and exits 1 at the end.
  ``--resume`` runs failed prompts again.
- Each result is appended as one whole line and flushed, so an interrupt leaves whole lines
  (``--resume`` drops a torn last line should the process be killed mid-write).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from cascade.cli import args as types
from cascade.cli.args import add_generation_args, guarded, main_topology


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="generate for every prompt of a JSONL file (locally or as a Ray job)",
                       description="Batch generation: read prompts (JSONL, a 'prompt' field per line), "
                                   "write one result per line, in input order.")
    p.add_argument("--prompts", required=True, help="input JSONL file: one {\"prompt\": ...} per line")
    p.add_argument("--output", "-o", required=True, help="output JSONL file (parent folders are created)")
    add_generation_args(p)
    p.add_argument("--backend", choices=("local", "ray"), default=None,
                   help="where the levels run (default: the topology's backend)")
    p.add_argument("--address", default=None,
                   help="Ray cluster: auto, local or host:port (default: the topology's ray.address)")
    p.add_argument("--limit", type=types.positive_int, default=None, help="only the first N prompts")
    again = p.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="keep the results already in --output and run only the prompts it lacks")
    again.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.set_defaults(func=run)


@guarded
def run(args) -> int:
    from cascade.tools.baselines import load_prompt_lines

    out_path = Path(args.output)
    problem = _output_problem(Path(args.prompts), out_path, args.resume, args.overwrite)
    if problem:
        print(f"cascade run: error: {problem}", file=sys.stderr)
        return 2
    prompts = load_prompt_lines(args.prompts, args.limit)
    done = _resume(out_path) if args.resume else set()
    todo = [(i, line, prompt) for i, (line, prompt) in enumerate(prompts) if line not in done]
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        if not args.resume:
            out_path.write_bytes(b"")
    except OSError as exc:  # e.g. a folder that may not be written
        print(f"cascade run: error: --output {out_path}: cannot write: {exc}", file=sys.stderr)
        return 2
    if done:
        print(f"resuming: {len(prompts) - len(todo)} of {len(prompts)} prompts already in {out_path}",
              file=sys.stderr)
    started = time.perf_counter()
    tokens, failed = _generate_all(args, todo, out_path, len(prompts))
    seconds = time.perf_counter() - started
    print(f"{len(todo) - failed} prompts, {tokens} tokens in {seconds:.2f} s -> {out_path}"
          + (f"; {failed} failed (error lines in the output)" if failed else ""))
    return 1 if failed else 0


def _generate_all(args, todo: list[tuple[int, int, str]], out_path: Path, total: int) -> tuple[int, int]:
    """Run every prompt of ``todo`` (index, input line, prompt), appending a line per prompt.
    Returns (tokens generated, prompts failed)."""
    from cascade.api import Cascade
    from cascade.errors import RequestError, WorkerError
    from policies import from_spec

    policy = from_spec(args.policy) if args.policy else None
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, stop=args.stop, coupling=args.coupling)
    tokens = failed = 0
    args.topology = args.topology or main_topology(lambda line: print(line, file=sys.stderr))
    with Cascade.from_topology(args.topology, policy=policy, device=args.device, backend=args.backend,
                               address=args.address) as c:
        for i, line, prompt in todo:
            seed = None if args.seed is None else args.seed + i
            try:
                g = c.generate(prompt, seed=seed, **kwargs)
            except (RequestError, WorkerError) as exc:
                record = {"line": line, "prompt": prompt, "error": str(exc)}
                partial = getattr(exc, "partial", None)
                if partial is not None:
                    record["partial"] = partial.to_dict() if hasattr(partial, "to_dict") else partial
                _append(out_path, record)
                print(f"error: {args.prompts}:{line} (prompt {i + 1}/{total}): {exc}", file=sys.stderr)
                failed += 1
                continue
            _append(out_path, {"line": line, **g.to_dict()})
            tokens += len(g.token_ids)
            for note in g.stats.notes:
                print(f"note: {args.prompts}:{line}: {note}", file=sys.stderr)
    return tokens, failed


def _output_problem(src: Path, out: Path, resume: bool, overwrite: bool) -> str | None:
    """Why writing ``out`` would lose work or cannot work, or None."""
    folder = next((p for p in out.parents if p.exists()), None)  # the nearest that exists
    if folder is not None and not folder.is_dir():
        return f"--output {out}: {folder} is a file, not a folder; choose another path"
    if out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(out, src)):
        return f"--output {out} is the input file; choose another path"
    if out.is_dir():
        return f"--output {out} is a directory"
    if out.exists() and out.stat().st_size > 0 and not (resume or overwrite):
        return (f"--output {out} already holds results; pass --resume to run only the prompts it lacks, "
                "or --overwrite to replace it")
    return None


def _resume(out_path: Path) -> set[int]:
    """Input lines already done in ``out_path``. Rewrites it (to a temporary file, then renamed
    over it) without error lines and a torn last line, so that what follows is appended to
    whole, successful results."""
    if not out_path.exists():
        return set()
    kept, done = [], set()
    for text in out_path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
        if isinstance(record, dict) and isinstance(record.get("line"), int) and "error" not in record:
            kept.append(text)
            done.add(record["line"])
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("".join(t + "\n" for t in kept), encoding="utf-8")
    os.replace(tmp, out_path)
    return done


def _append(path: Path, record: dict) -> None:
    """Append one whole line: a single write of the encoded line, flushed before returning."""
    data = (json.dumps(record) + "\n").encode("utf-8")
    with open(path, "ab", buffering=0) as f:
        f.write(data)
