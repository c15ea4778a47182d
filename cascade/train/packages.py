"""The rebuild corpus: the standard library plus the permissively licensed Python code that the
project's own dependencies install, written down once as a manifest and trained on from it.

Which distributions: the dependency closure of ``cascade-spec`` with its extras (what
``pip install cascade-spec[ray,plots,dev]`` brings), read from the installed metadata. Which are
kept: those whose declared licence is permissive (every term of an ``AND``, some term of an
``OR``: see :data:`PERMISSIVE`), minus the distributions the held-out and tuning prompts come
from (:func:`heldout_distributions`: networkx, attrs, click), so that the held-out measurements
stay held out. Which files: the distribution's own ``*.py`` files (its RECORD), without tests,
vendored third-party code, generated protobuf modules and files over 400 kB; a distribution
above ``cap_bytes`` contributes a fixed, hash-ordered subset of its files (so that torch,
transformers or sympy do not drown the rest).

The selection depends on what is installed, so training never reads it live: ``python -m
cascade.train.packages OUT.tsv`` writes the manifest (one row a file: distribution, version,
licence, root, path) and ``cascade distill --corpus manifest:OUT.tsv`` trains on exactly those
files (:func:`cascade.train.corpus.read_manifest`).
"""
from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

from cascade.train.corpus import (
    MAX_FILE_BYTES,
    read_text,
    STDLIB_LICENCE,
    ManifestRow,
    site_packages_root,
    stdlib_files,
    stdlib_root,
    write_manifest,
)
from cascade.train.heldout import HELDOUT_SOURCES, TUNING_SOURCES

PROJECT = "cascade-spec"
PROJECT_EXTRAS = ("ray", "plots", "dev")

#: SPDX ids whose code may be trained on and shipped as weights without conditions on the weights.
PERMISSIVE = frozenset({
    "MIT", "MIT-0", "MIT-CMU", "BSD", "BSD-2-Clause", "BSD-3-Clause", "0BSD", "ISC", "Zlib",
    "Apache-2.0", "Apache-2.0 WITH LLVM-exception", "PSF-2.0", "CNRI-Python", "BSL-1.0", "CC0-1.0",
    "Unlicense",
})

#: free-text ``License:`` fields and trove classifiers, as SPDX ids.
_LICENCE_NAMES = {
    "mit": "MIT", "mit license": "MIT", "mit license (mit)": "MIT",
    "bsd": "BSD", "bsd license": "BSD", "bsd-2-clause": "BSD-2-Clause", "bsd-3-clause": "BSD-3-Clause",
    "3-clause bsd license": "BSD-3-Clause", "bsd 3-clause license": "BSD-3-Clause",
    "modified bsd license": "BSD-3-Clause",
    "apache 2.0": "Apache-2.0", "apache-2.0": "Apache-2.0", "apache 2.0 license": "Apache-2.0",
    "apache license 2.0": "Apache-2.0", "apache license, version 2.0": "Apache-2.0",
    "apache software license": "Apache-2.0", "asl 2": "Apache-2.0",
    "psf-2.0": "PSF-2.0", "python software foundation license": "PSF-2.0",
    "isc license": "ISC", "isc license (iscl)": "ISC",
    "mpl-2.0": "MPL-2.0", "mozilla public license 2.0 (mpl 2.0)": "MPL-2.0",
}

#: path components that mark code that is not the distribution's own or not source.
EXCLUDED_DIRS = frozenset({
    "test", "tests", "testing", "__pycache__", "_vendor", "vendor", "vendored", "_vendored",
    "thirdparty", "third_party", "thirdparty_files", "_thirdparty", "extern", "_extern",
})

#: distributions above this many bytes of selected source contribute a subset of that size.
DEFAULT_CAP_BYTES = 3_000_000


def dependency_distributions(project: str = PROJECT, extras=PROJECT_EXTRAS) -> list[str]:
    """Names of the installed distributions that ``project[extras]`` requires, transitively."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    wanted: dict[str, set[str]] = {}
    names: dict[str, str] = {}
    todo = [(project, set(extras))]
    while todo:
        name, want = todo.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional requirement that is not installed
        key = canonicalize_name(name)
        if key in wanted and want <= wanted[key]:
            continue
        wanted[key] = wanted.get(key, set()) | want
        names[key] = dist.metadata["Name"]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ["", *wanted[key]]):
                todo.append((req.name, set(req.extras)))
    return sorted(names[k] for k in wanted if k != canonicalize_name(project))


def declared_licence(dist_name: str) -> str:
    """The distribution's licence as an SPDX-like expression: ``License-Expression`` if given,
    else the ``License:`` field when it names a licence, else its licence classifiers (several
    classifiers are alternatives, joined with OR); ``""`` when none says."""
    import importlib.metadata as md

    meta = md.distribution(dist_name).metadata
    if meta.get("License-Expression"):
        return meta["License-Expression"].strip()
    raw = (meta.get("License") or "").strip()
    if raw.lower() in _LICENCE_NAMES:
        return _LICENCE_NAMES[raw.lower()]
    if re.fullmatch(r"[A-Za-z0-9.+-]+( (AND|OR) [A-Za-z0-9.+-]+)+", raw):
        return raw  # already an SPDX expression
    classifiers = [c.split("::")[-1].strip().lower() for c in meta.get_all("Classifier") or []
                   if c.startswith("License ::")]
    ids = sorted({_LICENCE_NAMES.get(c, c) for c in classifiers})
    return " OR ".join(ids)


def is_permissive(expression: str) -> bool:
    """Whether an SPDX expression (``A AND B``, ``A OR B``, parentheses) is permissive: every term
    of an AND, some term of an OR, in :data:`PERMISSIVE`."""
    expr = expression.strip()
    if not expr:
        return False
    if expr.startswith("(") and _closing(expr) == len(expr) - 1:
        return is_permissive(expr[1:-1])
    for op, combine in ((" OR ", any), (" AND ", all)):
        parts = _split_top(expr, op)
        if len(parts) > 1:
            return combine(is_permissive(p) for p in parts)
    return expr in PERMISSIVE


def _closing(expr: str) -> int:
    depth = 0
    for i, ch in enumerate(expr):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i
    return -1


def _split_top(expr: str, op: str) -> list[str]:
    """Split at ``op`` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and expr.startswith(op, i):
            parts.append(expr[start:i])
            start = i + len(op)
    return parts + [expr[start:]]


def heldout_distributions() -> set[str]:
    """The distributions that the held-out and tuning prompts (and the held-out loss) come from."""
    import importlib.metadata as md

    owners = md.packages_distributions()
    return {d for pkg in (*HELDOUT_SOURCES, *TUNING_SOURCES) for d in owners.get(pkg, [pkg])}


def heldout_lines(min_chars: int = 30) -> set[str]:
    """The distinct long lines (stripped) of every Python file of the held-out distributions: the
    fingerprint that finds their code vendored inside other distributions (typer ships a copy of
    click as ``typer/_click``)."""
    import importlib.metadata as md

    lines: set[str] = set()
    for name in heldout_distributions():
        dist = md.distribution(name)
        for rel in dist.files or []:
            if str(rel).endswith(".py"):
                text = read_text(Path(dist.locate_file(rel))) or ""
                lines.update(_long_lines(text, min_chars))
    return lines


def _long_lines(text: str, min_chars: int) -> list[str]:
    """Stripped lines of at least ``min_chars``, imports left out (every file has the same ones)."""
    lines = (ln.strip() for ln in text.splitlines())
    return [t for t in lines if len(t) >= min_chars and not t.startswith(("from ", "import "))]


def copies_heldout(path: Path, fingerprint: set[str], share: float = 0.3, min_lines: int = 5,
                   min_chars: int = 30) -> bool:
    """Whether at least ``min_lines`` and ``share`` of the file's long lines are held-out code's."""
    long = _long_lines(read_text(path) or "", min_chars)
    found = sum(t in fingerprint for t in long)
    return found >= min_lines and found >= share * len(long)


def _under_heldout_name(path: str) -> bool:
    """A file in a directory named like a held-out package (``typer/_click/...``): vendored."""
    names = {*HELDOUT_SOURCES, *TUNING_SOURCES}
    return any(part.lstrip("_") in names for part in path.split("/")[:-1])


def distribution_files(dist_name: str) -> list[str]:
    """The distribution's own Python source files, relative to site-packages, sorted."""
    import importlib.metadata as md

    root = site_packages_root()
    out = []
    for rel in md.distribution(dist_name).files or []:
        path = rel.as_posix() if hasattr(rel, "as_posix") else str(rel)
        parts = path.split("/")
        if not path.endswith(".py") or path.startswith("..") or ".dist-info" in parts[0]:
            continue
        if any(p in EXCLUDED_DIRS for p in parts[:-1]) or _generated_or_test(parts[-1]):
            continue
        size = (root / path).stat().st_size if (root / path).is_file() else 0
        if 0 < size <= MAX_FILE_BYTES:
            out.append(path)
    return sorted(out)


def _generated_or_test(name: str) -> bool:
    return bool(re.search(r"_pb2(_grpc)?\.py$", name)) or name.startswith("test_") or name == "conftest.py"


def capped(paths: list[str], cap_bytes: int) -> list[str]:
    """At most ``cap_bytes`` of ``paths``: files taken in the order of a hash of their path (a
    spread over the whole package, the same on every machine), returned sorted."""
    root = site_packages_root()
    order = sorted(paths, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    kept, total = [], 0
    for p in order:
        size = (root / p).stat().st_size
        if total + size > cap_bytes:
            continue
        kept.append(p)
        total += size
    return sorted(kept)


def select_sources(cap_bytes: int = DEFAULT_CAP_BYTES) -> tuple[list[ManifestRow], dict]:
    """The rebuild corpus: the stdlib corpus, then each permissive dependency's files (capped).
    Returns the rows and a report of what was left out and why."""
    import importlib.metadata as md
    import platform

    base = stdlib_root()
    rows = [ManifestRow("python-stdlib", platform.python_version(), STDLIB_LICENCE, "stdlib",
                        f.relative_to(base).as_posix()) for f in stdlib_files()]
    left_out = {"held out": [], "not permissive": [], "no source": [], "copies of held-out code": []}
    heldout, fingerprint = heldout_distributions(), heldout_lines()
    for name in dependency_distributions():
        licence = declared_licence(name)
        if name in heldout:
            left_out["held out"].append(name)
        elif not is_permissive(licence):
            left_out["not permissive"].append(f"{name} ({licence or 'undeclared'})")
        else:
            own = distribution_files(name)
            copies = [f for f in own if _under_heldout_name(f)
                      or copies_heldout(site_packages_root() / f, fingerprint)]
            left_out["copies of held-out code"].extend(copies)
            files = capped([f for f in own if f not in copies], cap_bytes)
            if not files:
                left_out["no source"].append(name)
            version = md.distribution(name).version
            # a namespace package's __init__.py can be claimed by two distributions: list it once
            taken = {r.path for r in rows if r.root == "site-packages"}
            rows.extend(ManifestRow(name, version, licence, "site-packages", f) for f in files if f not in taken)
    return rows, left_out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0] if argv else "examples/models/CORPUS.tsv")
    rows, left_out = select_sources()
    notes = [f"left out, {why}: {', '.join(sorted(names)) or 'none'}" for why, names in left_out.items()]
    notes.append(f"per-distribution cap: {DEFAULT_CAP_BYTES:,} bytes of source (a hash-ordered subset above it)")
    write_manifest(rows, out, notes)
    print(f"wrote {len(rows)} files from {len({r.package for r in rows})} distributions to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
