"""Held-out code (not in the training corpus) and the prompt sets built from it.

The family is trained on the manifest ``examples/models/CORPUS.tsv`` (the standard library and the
dependencies' code), which leaves these packages out.  Held-out code comes from permissively
licensed third-party packages installed in this environment:

* ``examples/prompts/heldout.jsonl`` and the held-out loss text: ``networkx`` (BSD-3-Clause,
  ``networkx/algorithms/{shortest_paths,traversal,flow,components,centrality}``, test files
  excluded) and ``attrs`` (MIT, the ``attr`` package);
* ``examples/prompts/tuning.jsonl`` (policy tuning, disjoint files): ``click`` (BSD-3-Clause).

Regenerate the prompt files with ``python -m cascade.train.heldout`` (deterministic).
"""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from cascade.train.corpus import package_dir

HELDOUT_SOURCES = {
    "networkx": ("BSD-3-Clause", ["algorithms/shortest_paths", "algorithms/traversal", "algorithms/flow",
                                  "algorithms/components", "algorithms/centrality"]),
    "attr": ("MIT", ["."]),
}
TUNING_SOURCES = {
    "click": ("BSD-3-Clause", ["."]),
}


def source_files(sources: dict) -> list[tuple[str, str, Path]]:
    """(package, licence, path) of every non-test ``*.py`` file of ``sources``, sorted."""
    out = []
    for pkg, (licence, subdirs) in sources.items():
        base = package_dir(pkg)
        for sub in subdirs:
            for f in sorted((base / sub).glob("*.py")):
                if f.name.startswith("test") or "tests" in f.parts or f.name == "__init__.py":
                    continue
                out.append((pkg, licence, f))
    return out


def heldout_files() -> list[Path]:
    return [f for _, _, f in source_files(HELDOUT_SOURCES)]


def heldout_text(max_chars: int | None = None) -> str:
    """The held-out files concatenated (in order), for loss evaluation."""
    parts, total = [], 0
    for f in heldout_files():
        t = f.read_text(encoding="utf-8")
        parts.append(t)
        total += len(t)
        if max_chars is not None and total >= max_chars:
            break
    text = "".join(parts)
    return text if max_chars is None else text[:max_chars]


def _function_prompts(pkg: str, licence: str, path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        start = node.lineno - 1
        body0 = node.body[0]
        if (isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant)
                and isinstance(body0.value.value, str)):
            if body0.end_lineno - start <= 6 and len(node.body) > 1:
                # short docstring: signature + docstring + the first line of code
                end = node.body[1].lineno
            else:
                # signature + the first line(s) of the docstring
                end = min(body0.lineno + 1, body0.end_lineno)
        else:
            # signature + the first two lines of the body
            end = body0.lineno + 1
        end = min(end, start + 8, len(lines))
        prompt = "".join(lines[start:end])
        if len(prompt) < 40 or len(prompt) > 600:
            continue
        rel = path.relative_to(package_dir(pkg).parent).as_posix()
        prompts.append({"prompt": prompt, "source": f"{rel}:{node.lineno}", "package": pkg, "license": licence})
    prompts.sort(key=lambda p: int(p["source"].rsplit(":", 1)[1]))
    return prompts


def build_prompts(sources: dict, n: int, per_file: int = 3) -> list[dict]:
    """``n`` prompts spread evenly over the functions of ``sources`` (at most ``per_file`` each)."""
    pool = []
    for pkg, licence, f in source_files(sources):
        cands = _function_prompts(pkg, licence, f)
        if len(cands) > per_file:
            step = len(cands) / per_file
            cands = [cands[int(i * step)] for i in range(per_file)]
        pool.extend(cands)
    if len(pool) <= n:
        return pool
    step = len(pool) / n
    return [pool[int(i * step)] for i in range(n)]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def load_prompts(path: str | Path) -> list[str]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line)["prompt"] for line in fh if line.strip()]


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0] if argv else "examples/prompts")
    heldout = build_prompts(HELDOUT_SOURCES, 60)
    tuning = build_prompts(TUNING_SOURCES, 24)
    assert not {p["source"].split(":")[0] for p in heldout} & {p["source"].split(":")[0] for p in tuning}
    write_jsonl(heldout, out / "heldout.jsonl")
    write_jsonl(tuning, out / "tuning.jsonl")
    print(f"wrote {len(heldout)} held-out and {len(tuning)} tuning prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
