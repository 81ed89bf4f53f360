"""The README and docs/ stay true to each other and to the code they describe.

- Every relative link in README.md and docs/*.md reaches a file, and a `#anchor` a heading of
  that file (GitHub's rule: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for
  repeats). Links out (http:, https:, mailto:) are not followed.
- The README stays short (the rest belongs in docs/), and keeps the two commands CI and new
  users run.
- docs/architecture.md's module map names the modules of tests/unit/test_layers.py, each in its
  layer: the map's table (under "## Module map") gives a layer number in its first column and the
  layer's module as a backticked `cluster.*` name in its second.
- docs/README.md, the index, lists every page of docs/.
"""
from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 200

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links reduced to their words), lower case,
    every character but letters, digits, `_`, `-` and spaces dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in prose(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of a page's prose; inline code (`[x](y)` in backquotes) is no link."""
    found = []
    for line in prose(path.read_text()):
        found += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


def test_relative_links_reach_a_file_and_a_heading() -> None:
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no file {dest}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_slug_follows_github() -> None:
    assert slug("Copying code: `--sync`") == "copying-code---sync"
    assert slug("1. On this machine") == "1-on-this-machine"
    assert slug("The reference trainer (`train/`)") == "the-reference-trainer-train"
    assert slug("See [the docs](docs/README.md) here") == "see-the-docs-here"


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into docs/"


def test_readme_keeps_the_two_commands() -> None:
    """CI (.ci/run) and a new user run what the Quickstart says: install and run, then the suite."""
    lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    assert "pip install -e '.[train]' && cluster up" in lines
    assert "tests/run" in lines


def module_map() -> dict[str, int]:
    """{module: layer} from the table under "## Module map" in docs/architecture.md."""
    lines = prose((DOCS / "architecture.md").read_text())
    start = lines.index("## Module map")
    table = []
    for line in lines[start + 1:]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    found: dict[str, int] = {}
    for row in table[2:]:                       # after the header and the |---| line
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name in re.findall(r"`(cluster(?:\.\w+)*)`", cells[1]):
            assert name not in found, f"docs/architecture.md: {name} is in the map twice"
            found[name] = int(cells[0])
    return found


def test_module_map_names_the_layers_modules() -> None:
    want = {name: rank for rank, group in enumerate(LAYERS) for name in group}
    have = module_map()
    assert have, "docs/architecture.md: no module map table under '## Module map'"
    assert sorted(set(have) - set(want)) == [], "in the map but not in LAYERS (test_layers.py)"
    assert sorted(set(want) - set(have)) == [], "in LAYERS (test_layers.py) but not in the map"
    moved = {n: (have[n], want[n]) for n in want if have[n] != want[n]}
    assert moved == {}, "module: (layer in the map, layer in LAYERS)"


def test_the_index_lists_every_page() -> None:
    listed = {Path(t.partition("#")[0]).name for t in links(DOCS / "README.md")}
    missing = sorted(p.name for p in DOCS.glob("*.md") if p.name not in listed | {"README.md"})
    assert missing == [], f"docs/README.md does not list {missing}"
