"""The README and docs/ hold together: relative links (and their #anchors) resolve, the README's
two Quickstart commands are the ones it promises (and `.ci/run` runs the second), the reading
order names files that exist, no text cites an issue number, and the README stays short.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEMO = "pip install torch==2.13.0 && pip install -e . && cascade pull smollm2-135m-instruct && cascade demo"
TESTS = 'pip install torch==2.13.0 && pip install -e ".[dev]" && python -m pytest'


def documents() -> list[Path]:
    found = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples" / "README.md",
             ROOT / "cascade" / "DESIGN.md"]
    return [p for p in found if p.is_file()]


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code: links live only in prose."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def links(text: str) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in links(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_doc_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README.read_text())}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs/ files the README does not link: {unlinked}"


def test_quickstart_commands():
    text = README.read_text()
    quickstart = text[text.index("## Quickstart"):]
    quickstart = quickstart[:quickstart.index("\n## ", 1)]
    commands = re.findall(r"```bash\n(.*?)\n```", quickstart, flags=re.S)
    assert commands == [DEMO, TESTS]


def test_ci_runs_the_readmes_test_command():
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [x for x in lines if x and not x.startswith("#")]
    assert commands[-1] == TESTS


def test_reading_order_names_files_that_exist():
    text = README.read_text()
    order = text[text.index("Read in this order:"):].split("```")[0]
    paths = re.findall(r"^\d+\. `([^`]+)`", order, flags=re.M)
    assert paths[0] == "cascade/verify.py" and paths[-1] == "cascade/DESIGN.md"
    assert [p for p in paths if not (ROOT / p).is_file()] == []


def test_no_issue_numbers_in_the_text():
    cited = [f"{p.relative_to(ROOT)}: {m}" for p in (README, *sorted((ROOT / "docs").glob("*.md")))
             for m in re.findall(r"\bissues? \d+", p.read_text(), flags=re.I)]
    assert not cited, cited


def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) <= 300  # the rest belongs in docs/
