"""Training corpora, the byte-level BPE tokenizer and token datasets for ``cascade distill``.

The default corpus is the pure-Python part of the CPython standard library that ships with the
interpreter (PSF License).  ``stdlib_files()`` selects it reproducibly:
every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, excluding installed third-party
packages (``site-packages``/``dist-packages``), test suites and a few tool directories whose
contents are mostly test data or generated tables (see ``STDLIB_EXCLUDED_DIRS``).

A corpus can also be a manifest (``manifest:PATH``): a list of files with their package, version
and licence, relative to the stdlib or site-packages of this interpreter (written by
:mod:`cascade.train.packages` for the family rebuild), so that what is trained on is fixed in the
repository rather than by what happens to be installed.  The bundled family is trained on one:
``examples/models/CORPUS.tsv``.

Heavy imports (torch, tokenizers, transformers) happen inside the functions that need them.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

EOS_TOKEN = "<|endoftext|>"

#: directory names (any path component) skipped when collecting the stdlib corpus.
STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "__pycache__",
        "turtledemo",
        "ensurepip",
        "config-3.11-x86_64-linux-gnu",
    }
)

#: single files excluded from the stdlib corpus: huge generated tables that are not code.
STDLIB_EXCLUDED_FILES = frozenset({"pydoc_data/topics.py", "encodings/mac_latin2.py"})

#: files larger than this (bytes) are skipped: they are generated data, not source.
MAX_FILE_BYTES = 400_000

SOURCE_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst")

STDLIB_LICENCE = "PSF-2.0"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def site_packages_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"]).resolve()


def stdlib_files(root: str | os.PathLike | None = None) -> list[Path]:
    """The Python files of the standard library used as the default training corpus, sorted."""
    base = Path(root).resolve() if root else stdlib_root()
    out = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part in STDLIB_EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if rel.as_posix() in STDLIB_EXCLUDED_FILES or rel.name.startswith("test_"):
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size == 0:
                continue
        except OSError:
            continue
        out.append(path)
    return out


def package_dir(name: str) -> Path:
    """Directory of an installed package (for corpus specs of the form ``pkg:NAME``)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"installed package not found: {name}")
    return Path(list(spec.submodule_search_locations)[0])


def collect_files(specs: Sequence[str], suffixes: Iterable[str] = SOURCE_SUFFIXES) -> list[Path]:
    """Resolve corpus specs: ``stdlib``, ``pkg:NAME`` (an installed package's directory, e.g.
    ``pkg:attr``), ``manifest:PATH`` (the files a manifest lists), files, or directories
    (searched recursively for ``suffixes``)."""
    suffixes = tuple(suffixes)
    files: list[Path] = []
    for spec in specs:
        if spec == "stdlib":
            files.extend(stdlib_files())
            continue
        if spec.startswith("manifest:"):
            files.extend(row.file() for row in read_manifest(spec[len("manifest:"):]))
            continue
        path = package_dir(spec[4:]) if spec.startswith("pkg:") else Path(spec)
        if path.is_dir():
            for f in sorted(path.rglob("*")):
                if f.is_file() and f.suffix in suffixes and "__pycache__" not in f.parts:
                    files.append(f)
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus path not found: {spec}")
    seen, unique = set(), []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if not unique:
        raise ValueError(f"no corpus files found in {list(specs)}")
    return unique


class ManifestRow(NamedTuple):
    """One file of a corpus manifest: where it comes from and under which licence."""

    package: str  # the distribution (``python-stdlib`` for the standard library)
    version: str
    licence: str  # SPDX expression as the distribution declares it
    root: str  # "stdlib" or "site-packages" (of the interpreter that reads the manifest)
    path: str  # relative to the root, POSIX separators

    def file(self) -> Path:
        roots = {"stdlib": stdlib_root, "site-packages": site_packages_root}
        if self.root not in roots:
            raise ValueError(f"manifest row {self.path!r}: unknown root {self.root!r} (stdlib, site-packages)")
        return roots[self.root]() / self.path


MANIFEST_COLUMNS = ManifestRow._fields


def write_manifest(rows: Sequence[ManifestRow], path: str | os.PathLike, notes: Sequence[str] = ()) -> None:
    """A tab-separated manifest: ``#`` comment lines (notes, totals), a header, one row a file."""
    sizes: dict[tuple[str, str], int] = {}
    for r in rows:
        key = (r.package, r.licence)
        sizes[key] = sizes.get(key, 0) + r.file().stat().st_size
    lines = [f"# {len(rows)} files, {sum(sizes.values()):,} bytes, {len(sizes)} packages",
             *(f"# {n}" for n in notes),
             *(f"# {pkg} ({lic}): {b:,} bytes" for (pkg, lic), b in sorted(sizes.items())),
             "\t".join(MANIFEST_COLUMNS), *("\t".join(r) for r in rows)]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def read_manifest(path: str | os.PathLike) -> list[ManifestRow]:
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if tuple(cells) == MANIFEST_COLUMNS:
            continue
        if len(cells) != len(MANIFEST_COLUMNS):
            raise ValueError(f"{path}: a row needs {len(MANIFEST_COLUMNS)} tab-separated cells "
                             f"{MANIFEST_COLUMNS}: {line[:80]!r}")
        rows.append(ManifestRow(*cells))
    return rows


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def read_texts(files: Sequence[Path]) -> list[str]:
    return [t for t in (read_text(f) for f in files) if t]


# --------------------------------------------------------------------------- tokenizer


#: How text is cut before BPE merges (the pieces are then byte-level encoded). GPT-2's pattern
#: puts a newline and the next line's indentation in one piece (``"\n       "``), so a prompt
#: ending in a newline (``"def f(x):\n"``) ends in a token that training text almost never
#: continues with indented code: models write column-0 text and loop. This pattern (the shape of
#: cl100k's) ends a piece at every newline, so text cut after a newline that starts a line of
#: text tokenizes as a prefix of the whole (newlines in a row stay one piece); indentation is a
#: piece of its own, less one space that leads the next word.
PRETOKENIZE_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                       r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def pre_tokenizer():
    """The pre-tokenizer of :func:`train_tokenizer`: :data:`PRETOKENIZE_PATTERN`, then bytes."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def train_tokenizer(texts: Sequence[str], out_dir: str | os.PathLike, vocab_size: int = 4096,
                    model_max_length: int = 1024):
    """Train a byte-level BPE tokenizer on ``texts`` and save it (HF format) in ``out_dir``.

    Byte-level pre-tokenisation makes every string representable and decoding exact (tabs,
    trailing spaces, ``\\r\\n``, any unicode); pieces end at newlines
    (:data:`PRETOKENIZE_PATTERN`).  ``<|endoftext|>`` is the only special token and serves as
    EOS (also set as BOS/PAD/UNK so generic code finds one).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out)
    from cascade.train.family import portable_tokenizer_config

    portable_tokenizer_config(out)
    return hf


def load_tokenizer(path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


# --------------------------------------------------------------------------- datasets


def encode_corpus(texts: Sequence[str], tokenizer, cache: str | os.PathLike | None = None):
    """Concatenate the documents, each followed by EOS, into one int32 tensor of token ids."""
    import torch

    if cache is not None and Path(cache).exists():
        return torch.load(cache)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    batch = 256
    for i in range(0, len(texts), batch):
        enc = tokenizer(list(texts[i : i + batch]), add_special_tokens=False)["input_ids"]
        for doc in enc:
            ids.extend(doc)
            ids.append(eos)
    data = torch.tensor(ids, dtype=torch.int32)
    if cache is not None:
        Path(cache).parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, cache)
    return data


class WindowSampler:
    """Random fixed-length windows from a flat token tensor, reproducible from (seed, step).

    Each step's batch is a pure function of the seed and the step index, so a resumed run sees
    exactly the batches an uninterrupted run would have seen.
    """

    def __init__(self, data, seq_len: int, batch_size: int, seed: int = 0):
        if data.numel() <= seq_len + 1:
            raise ValueError(f"corpus too small ({data.numel()} tokens) for seq_len {seq_len}")
        self.data, self.seq_len, self.batch_size, self.seed = data, seq_len, batch_size, seed

    def batch(self, step: int):
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=g)
        rows = [self.data[s : s + self.seq_len + 1] for s in starts.tolist()]
        return torch.stack(rows).long()


def fixed_windows(data, seq_len: int, max_windows: int | None = None):
    """Non-overlapping consecutive windows (for evaluation), as a LongTensor [n, seq_len+1]."""
    import torch

    n = (data.numel() - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    rows = [data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.stack(rows).long() if rows else torch.empty(0, seq_len + 1, dtype=torch.long)
