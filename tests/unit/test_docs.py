"""The README and the guide stay true to the tree: docs/architecture.md's module map names every
module of tpify/ and nothing that is not there; every relative link of README.md and docs/*.md
reaches a file (and its heading, for a link with an anchor); the README stays a front door of at
most 250 lines. Nothing here imports tpify: the files are read and parsed (``ast``)."""

import ast
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tpify"
ARCH = ROOT / "docs" / "architecture.md"
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _section(text: str, heading: str) -> str:
    """The lines of the ``## heading`` section (up to the next ``## ``), fences included."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1:end])


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: markdown marks dropped, lower case, punctuation removed,
    spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.replace("`", "").lower()
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


# --- the module map ---------------------------------------------------------------------------

def _tree_modules() -> set[str]:
    """Every Python file of tpify/, as a path relative to tpify/ (``api.py``, ``hooks/dropout.py``)."""
    return {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}


def _map_rows() -> list[tuple[int, str]]:
    """(line number, first cell) of every table row under docs/architecture.md's "## The module
    map": each names one module, relative to tpify/ (``tpify/`` in front is allowed)."""
    text = ARCH.read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "## The module map")
    rows = []
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line.startswith("## "):
            break
        if not line.startswith("|") or re.match(r"^\|\s*-", line):
            continue
        cell = line.split("|")[1].strip()
        if cell in ("module", "file"):
            continue
        match = re.fullmatch(r"`([^`]+)`", cell)
        assert match, f"docs/architecture.md:{i + 1}: a module map row names no `module`: {line[:80]!r}"
        rows.append((i + 1, match.group(1).removeprefix("tpify/")))
    return rows


def test_module_map_names_only_modules_that_exist():
    missing = [f"docs/architecture.md:{number}: `{name}` is in the module map, but tpify/{name} does not exist"
               for number, name in _map_rows() if not (PKG / name).is_file()]
    assert not missing, "\n".join(missing)


def test_every_module_is_in_the_module_map():
    mapped = {name for _, name in _map_rows()}
    unmapped = sorted(_tree_modules() - mapped)
    assert not unmapped, "\n".join(
        f"tpify/{name} is not in docs/architecture.md's module map (add a row `{name}` | what it owns)"
        for name in unmapped)


def test_module_map_has_no_duplicate_rows():
    names = [name for _, name in _map_rows()]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"docs/architecture.md's module map lists these more than once: {twice}"


def _defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assigned names of a module (parsed, not imported)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _resolve(dotted: str) -> str | None:
    """None if ``dotted`` (``api.prepare``, ``hooks.guards.install``, ``io.files``) names a module
    of tpify/ or a name defined at the top of one; else what is missing. Names whose first part is
    no tpify module (``torch.chunk``, ``model.tp_info``) are not tpify's: None."""
    if dotted.endswith(".py"):
        return None if (PKG / dotted.replace(".", "/", dotted.count(".") - 1)).is_file() else f"tpify/{dotted} does not exist"
    parts = dotted.split(".")
    if not ((PKG / f"{parts[0]}.py").is_file() or (PKG / parts[0]).is_dir()):
        return None
    path = PKG
    for i, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
            continue
        if (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
            rest = parts[i + 1:]
            break
        module = path / "__init__.py"
        if path.is_dir() and module.is_file() and part in _defined_names(module):
            return None
        return f"tpify/{path.relative_to(PKG).as_posix()} has no module or name `{part}`"
    else:
        return None
    if rest and rest[0] not in _defined_names(path):
        return f"tpify/{path.relative_to(PKG).as_posix()} defines no `{rest[0]}`"
    return None


def test_architecture_names_exist():
    """Every ``tpify/...`` path written anywhere on the page exists, and every dotted name of the
    walk-through (``api.prepare``, ``hooks.guards.install``) is defined where the page says."""
    text = ARCH.read_text()
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for path in re.findall(r"\btpify/[\w/.]*\w", line):
            if not (ROOT / path).exists():
                problems.append(f"docs/architecture.md:{number}: {path} does not exist")
    walk = _section(text, "## Following one model through `parallelize`")
    for dotted in sorted(set(re.findall(r"`([a-z_]\w*(?:\.\w+)+)`", walk))):
        problem = _resolve(dotted)
        if problem:
            problems.append(f"docs/architecture.md, the walk-through names `{dotted}`: {problem}")
    assert not problems, "\n".join(problems)


# --- links -------------------------------------------------------------------------------------

def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_reach_files_and_headings():
    problems = []
    anchors: dict[Path, set[str]] = {}
    for page in _pages():
        for number, line in _prose_lines(page.read_text()):
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                where = f"{page.relative_to(ROOT)}:{number}: [{target}]"
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    problems.append(f"{where}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} "
                                    "does not exist")
                    continue
                if anchor and dest.suffix == ".md":
                    known = anchors.setdefault(dest, _anchors(dest))
                    if anchor not in known:
                        problems.append(f"{where}: {dest.relative_to(ROOT)} has no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_readme_cites_only_the_repository():
    """What the README links to lives in the repository (docs/, recipes/, ...), not elsewhere."""
    outside = [target for _, line in _prose_lines((ROOT / "README.md").read_text())
               for target in _LINK.findall(line) if re.match(r"^[a-z][a-z0-9+.-]*:", target)]
    assert not outside, outside


# --- the README --------------------------------------------------------------------------------

def test_readme_is_a_front_door():
    """At most 250 lines, and its first two commands are the main job and the test suite."""
    text = (ROOT / "README.md").read_text()
    count = len(text.splitlines())
    assert count <= README_MAX_LINES, (f"README.md has {count} lines, more than {README_MAX_LINES}: move the "
                                       "detail into the docs/ page it belongs to and link it")
    block = text[text.index("```bash\n") + len("```bash\n"):]
    first_two = [line.split("#")[0].strip() for line in block.splitlines()[:2]]
    assert first_two == ["tpify finetune", "python -m pytest -q tests"], first_two
