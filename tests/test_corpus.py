"""The rebuild corpus (cascade.train.packages): permissive licences only, the held-out and tuning
packages kept out (vendored copies too), and a manifest that training reads back exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from cascade.train import packages
from cascade.train.corpus import ManifestRow, collect_files, read_manifest, stdlib_root, write_manifest

MANIFEST = Path(__file__).resolve().parents[1] / "examples" / "models" / "CORPUS.tsv"


@pytest.mark.parametrize("expression, permissive", [
    ("MIT", True), ("BSD-3-Clause", True), ("PSF-2.0", True),
    ("Apache-2.0 AND Apache-2.0 WITH LLVM-exception AND BSD-3-Clause AND MIT", True),
    ("Apache-2.0 OR BSD-3-Clause", True),
    ("MPL-2.0 AND MIT", False),  # tqdm: an AND needs every term
    ("GPL-3.0-only OR MIT", True),  # an OR needs one
    ("(GPL-2.0 OR MPL-2.0) AND MIT", False),
    ("(MIT OR GPL-2.0) AND BSD-2-Clause", True),
    ("GPL-2.0", False), ("LGPL-2.1", False), ("", False), ("Proprietary", False),
])
def test_licence_expressions(expression, permissive):
    assert packages.is_permissive(expression) is permissive


def test_declared_licences_of_known_distributions():
    assert packages.declared_licence("networkx") == "BSD-3-Clause"  # License-Expression
    assert packages.declared_licence("PyYAML") == "MIT"  # License: field
    assert not packages.is_permissive(packages.declared_licence("tqdm"))  # MPL-2.0 AND MIT


def test_heldout_distributions_are_the_prompt_sources():
    assert {"networkx", "attrs", "click"} <= packages.heldout_distributions()


def test_the_dependency_closure_is_what_the_project_installs():
    deps = packages.dependency_distributions()
    assert {"torch", "transformers", "networkx", "pydantic", "PyYAML", "numpy"} <= set(deps)
    assert "cascade-spec" not in deps and "moto" not in deps  # installed here, but no dependency


def test_vendored_heldout_code_is_recognised(tmp_path):
    fingerprint = packages.heldout_lines()
    click_core = Path(__import__("click").__file__).parent / "core.py"
    assert packages.copies_heldout(click_core, fingerprint)
    assert not packages.copies_heldout(stdlib_root() / "textwrap.py", fingerprint)
    assert packages._under_heldout_name("typer/_click/core.py")
    assert not packages._under_heldout_name("typer/main.py")


def test_capped_takes_a_fixed_subset_under_the_cap():
    files = packages.distribution_files("PyYAML")
    kept = packages.capped(files, 60_000)
    root = packages.site_packages_root()
    assert 0 < len(kept) < len(files)
    assert sum((root / f).stat().st_size for f in kept) <= 60_000
    assert kept == packages.capped(list(reversed(files)), 60_000)  # order-free


def test_manifest_round_trip_and_corpus_spec(tmp_path):
    rows = [ManifestRow("python-stdlib", "3", "PSF-2.0", "stdlib", "textwrap.py"),
            ManifestRow("PyYAML", "6", "MIT", "site-packages", "yaml/__init__.py")]
    path = tmp_path / "m.tsv"
    write_manifest(rows, path, ["a note"])
    assert read_manifest(path) == rows
    assert "# a note" in path.read_text()
    assert collect_files([f"manifest:{path}"]) == [r.file() for r in rows]
    path.write_text("package\tversion\nx\ty\n")
    with pytest.raises(ValueError, match="5 tab-separated cells"):
        read_manifest(path)


def test_the_committed_manifest():
    rows = read_manifest(MANIFEST)
    by_package: dict[str, int] = {}
    for r in rows:
        by_package[r.package] = by_package.get(r.package, 0) + 1
        assert packages.is_permissive(r.licence), r
        assert r.root in ("stdlib", "site-packages")
        assert not packages._under_heldout_name(r.path), r
    assert not set(by_package) & packages.heldout_distributions()
    assert {"python-stdlib", "numpy", "torch", "transformers", "pydantic", "PyYAML"} <= set(by_package)
    assert len(by_package) >= 50 and len(rows) >= 3000
    assert len({(r.root, r.path) for r in rows}) == len(rows)  # each file once
    # the held-out prompts' files are not in it
    from cascade.train.heldout import HELDOUT_SOURCES, TUNING_SOURCES, source_files

    names = {f"{p}/{f.name}" for p, _, f in source_files({**HELDOUT_SOURCES, **TUNING_SOURCES})}
    assert not {r.path for r in rows} & names
