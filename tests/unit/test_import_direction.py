"""Imports go one way: cli -> authoring / integrations -> api -> the rest (docs: STYLE.md, "Layout
that shows the architecture").

Every file of ``tpify/`` is parsed with :mod:`ast` (nothing is imported), and every import of a
``tpify`` module it holds is listed: absolute and relative, at the top and inside functions.
:data:`RULES` says, per package, which packages may import it; a rule is one row.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tpify

ROOT = Path(tpify.__file__).resolve().parent

# package -> the packages whose modules may import it (a package includes its submodules).
# The face (tpify/__init__.py) may import the verbs; it reaches the integrations lazily by name.
_ABOVE_API = ("tpify.cli", "tpify.authoring", "tpify.integrations")
RULES: dict[str, tuple[str, ...]] = {
    "tpify.cli": ("tpify.cli",),
    "tpify.authoring": ("tpify.cli", "tpify.authoring"),
    "tpify.integrations": _ABOVE_API,
    # pipeline stages sit on the core beside the integrations (a parallelized model is cut into stages,
    # from_pretrained reads a stage); the core never imports them
    "tpify.api": _ABOVE_API + ("tpify.api", "tpify.pipeline"),
    "tpify.pipeline": _ABOVE_API + ("tpify.pipeline",),
}
# The leaves: what tpify sets on a model, and the facts about HF modules, import nothing of tpify
# but these (one-way core: everything reads them, they read nothing above them).
LEAVES: dict[str, tuple[str, ...]] = {
    "tpify.hf_modules": (),
    "tpify.sharding": ("tpify.comm",),
    "tpify.info": ("tpify.comm", "tpify.sharding"),
    "tpify.comm": (),
    "tpify.syncs": (),
    "tpify.agree": ("tpify.comm",),
    "tpify.dcp_entries": ("tpify.sharding",),
}
# Inside the comm package, one job per module, imported one way: a module imports only those listed.
COMM: dict[str, tuple[str, ...]] = {
    "tpify.comm.counting": (),
    "tpify.comm.groups": (),
    "tpify.comm.collectives": ("tpify.comm.counting", "tpify.comm.groups"),
    "tpify.comm.regions": ("tpify.comm.collectives", "tpify.comm.groups"),
    "tpify.comm.rows": ("tpify.comm.collectives", "tpify.comm.groups"),
    "tpify.comm.ring": ("tpify.comm.counting", "tpify.comm.groups"),
    "tpify.comm.ulysses": ("tpify.comm.counting", "tpify.comm.groups"),
    "tpify.comm.deferred": (),
    "tpify.comm.inputs": ("tpify.comm.collectives", "tpify.comm.deferred", "tpify.comm.groups"),
}
# Inside the loss package, one job per module, imported one way: the named steps below the losses.
LOSS: dict[str, tuple[str, ...]] = {
    "tpify.loss.steps": ("tpify.comm",),
    "tpify.loss.cross_entropy": ("tpify.loss.steps",),
    "tpify.loss.statistics": ("tpify.loss.cross_entropy", "tpify.loss.steps"),
    "tpify.loss.chunked": ("tpify.comm", "tpify.layers", "tpify.loss.steps"),
}
# Inside the layers package, likewise: what every layer shares, the region entry, then the layers.
LAYERS: dict[str, tuple[str, ...]] = {
    "tpify.layers.common": ("tpify.context", "tpify.sharding"),
    "tpify.layers.region": ("tpify.comm", "tpify.context", "tpify.layers.common"),
    "tpify.layers.linear": ("tpify.comm", "tpify.context", "tpify.hf_modules", "tpify.sharding",
                            "tpify.layers.common", "tpify.layers.region"),
    "tpify.layers.embedding": ("tpify.comm", "tpify.context", "tpify.sharding", "tpify.layers.common"),
}


# Packages of the core whose files import no tpify module but these (the direction inside the core):
# the styles are below the recipe, the layout and the hooks (they own their module hooks and read
# no layout); the model-level hooks read the layout as data, never the styles, the recipe or the
# planner; transformers' plans are imported through the recipe and the styles.
BELOW: dict[str, tuple[str, ...]] = {
    "tpify.styles": ("tpify.styles", "tpify.comm", "tpify.context", "tpify.hf_modules", "tpify.layers",
                     "tpify.sharding", "tpify.syncs"),
    "tpify.hooks": ("tpify.hooks", "tpify.agree", "tpify.comm", "tpify.context", "tpify.context_parallel",
                    "tpify.grad_sums", "tpify.hf_modules", "tpify.info", "tpify.layers", "tpify.loss",
                    "tpify.random", "tpify.sharding", "tpify.syncs"),
    "tpify.hf_plan": ("tpify.hf_plan", "tpify.hf_modules", "tpify.recipe", "tpify.styles"),
    "tpify.recipe": ("tpify.hf_modules", "tpify.loss", "tpify.styles"),
    "tpify.compose": ("tpify.hf_modules", "tpify.recipe", "tpify.styles"),
    "tpify.planner": ("tpify.hf_modules", "tpify.recipe", "tpify.sharding", "tpify.styles"),
}
# Modules only their own package's face may import (implementation details behind it).
BEHIND: dict[str, tuple[str, ...]] = {
    "tpify.planner": ("tpify.layout",),
    "tpify.hf_plan.state": ("tpify.hf_plan",),
    "tpify.hf_plan.leftovers": ("tpify.hf_plan",),
    "tpify.hf_plan.refused": ("tpify.hf_plan",),
    "tpify.styles.experts_hooks": ("tpify.styles",),
}


def _module_name(path: Path, root: Path) -> str:
    """``tpify.authoring.verify`` for ``root/authoring/verify.py`` (``root`` is the ``tpify`` folder)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def tpify_imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """``[(line, module)]``: every ``tpify`` module (or name in a ``tpify`` package) ``path`` imports.

    ``from X import a`` counts as importing ``X`` and ``X.a`` (``a`` may be a submodule); a
    relative import is resolved against the file's package.
    """
    name = _module_name(path, root)
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = ".".join(package[:len(package) - (node.level - 1)])
                base = f"{anchor}.{base}" if base else anchor
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return [(line, n) for line, n in found if n == "tpify" or n.startswith("tpify.")]


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _violations() -> list[str]:
    """One line per import statement that breaks a rule."""
    out: dict[tuple, str] = {}
    for path in sorted(ROOT.rglob("*.py")):
        importer = _module_name(path, ROOT)
        for line, name in tpify_imports(path):
            for package, allowed in RULES.items():
                if importer == "tpify" and package == "tpify.api":
                    continue  # the face (tpify/__init__.py) exports the verbs
                if _inside(name, package) and not any(_inside(importer, a) for a in allowed):
                    out.setdefault((path, line, package), f"{path.relative_to(ROOT.parent)}:{line}: {importer} imports "
                                                          f"{name} (only {', '.join(allowed)} may import {package})")
    return list(out.values())


def test_imports_go_one_way():
    problems = _violations()
    assert not problems, "\n".join(problems)


def test_the_leaves_of_the_core_import_only_below_them():
    """``hf_modules``, ``comm``, ``sharding``, ``info`` and ``agree`` read no other tpify module
    than the ones listed: the core's imports form no circle through them."""
    problems = []
    for leaf, allowed in LEAVES.items():
        for path in _files(leaf):
            for line, name in tpify_imports(path):
                if name == "tpify":  # ``from . import comm`` names the package, then the module
                    continue
                if name != leaf and not _inside(name, leaf) and not any(_inside(name, a) for a in allowed):
                    problems.append(f"{path.relative_to(ROOT.parent)}:{line}: {leaf} imports {name}")
    assert not problems, "\n".join(problems)


def test_the_comm_modules_import_one_way():
    """Each module of ``tpify.comm`` (one job each) imports only the ones :data:`COMM` lists, and
    every module of the package is listed."""
    _check_package_table("tpify.comm", COMM, "COMM")


def test_the_loss_modules_import_one_way():
    """Each module of ``tpify.loss`` (one job each) imports only the ones :data:`LOSS` lists, and
    every module of the package is listed."""
    _check_package_table("tpify.loss", LOSS, "LOSS")


def test_the_layers_modules_import_one_way():
    """Each module of ``tpify.layers`` (one job each) imports only the ones :data:`LAYERS` lists,
    and every module of the package is listed."""
    _check_package_table("tpify.layers", LAYERS, "LAYERS")


def _check_package_table(package: str, table: dict[str, tuple[str, ...]], table_name: str) -> None:
    modules = {_module_name(p, ROOT) for p in _files(package)} - {package}
    assert modules == set(table), f"list every module of {package} in {table_name}: {sorted(modules ^ set(table))}"
    problems = []
    for module, allowed in table.items():
        path = _files(module)[0]
        for line, name in tpify_imports(path):
            if name == "tpify":  # ``from .. import comm`` names the package, then the module
                continue
            if name != module and not any(name == a or name.startswith(a + ".") for a in allowed):
                problems.append(f"{path.relative_to(ROOT.parent)}:{line}: {module} imports {name}")
    assert not problems, "\n".join(problems)


def _files(module: str) -> list[Path]:
    """The files of ``module``: its ``.py`` file, or every file of its package."""
    base = ROOT.joinpath(*module.split(".")[1:])
    return sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]


def test_the_core_imports_go_down():
    """Each package of :data:`BELOW` imports no tpify module but those listed (the styles own
    their module hooks and are imported by the recipe, the planner and transformers' plans, never
    the other way round; the model-level hooks never read the styles, the recipe or the planner)."""
    problems = []
    for package, allowed in BELOW.items():
        for path in _files(package):
            for line, name in tpify_imports(path):
                if name == "tpify" or any(_inside(name, a) for a in allowed):
                    continue
                problems.append(f"{path.relative_to(ROOT.parent)}:{line}: {package} imports {name}")
    assert not problems, "\n".join(problems)


def test_modules_behind_a_face_are_imported_only_by_it():
    """The planner is imported by the layout only, the parts of tpify.hf_plan and the experts'
    hooks by their own package only."""
    problems = []
    for path in sorted(ROOT.rglob("*.py")):
        importer = _module_name(path, ROOT)
        for line, name in tpify_imports(path):
            for module, allowed in BEHIND.items():
                if _inside(name, module) and importer != module and not any(_inside(importer, a) for a in allowed):
                    problems.append(f"{path.relative_to(ROOT.parent)}:{line}: {importer} imports {name} (only "
                                    f"{', '.join(allowed)} may)")
    assert not problems, "\n".join(problems)


def test_the_core_has_no_circle():
    """No tpify module reaches itself through its top-level imports (the import graph, drawn
    from the code, is a DAG; imports inside functions are the lazy exceptions they are)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        importer = _module_name(path, ROOT)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {name for line, name in tpify_imports(path) if any(n.lineno == line for n in top)}
        graph[importer] = {n for n in names if n not in (importer, "tpify")}  # "tpify": ``from . import x``
    modules = set(graph)
    edges = {m: {_owner(n, modules) for n in targets} - {None, m} for m, targets in graph.items()}
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1 and not cycle:
                cycle.extend(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycle, " -> ".join(cycle)


def _owner(name: str, modules: set[str]) -> str | None:
    """The module ``name`` lives in (``tpify.comm.agree`` -> ``tpify.comm``), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@pytest.mark.parametrize("where, source, expected", [
    ("authoring/x.py", "from .. import comm\n", "tpify.comm"),
    ("authoring/x.py", "from ..cli.target import f\n", "tpify.cli.target"),
    ("authoring/__init__.py", "from .plan import f\n", "tpify.authoring.plan"),
    ("cli/__init__.py", "from . import plan\n", "tpify.cli.plan"),
    ("x.py", "def f():\n    import tpify.cli.plan\n", "tpify.cli.plan"),
    ("x.py", "from tpify import authoring\n", "tpify.authoring"),
])
def test_imports_are_found_everywhere(tmp_path, where, source, expected):
    """Relative imports, imports inside functions and ``from tpify import package`` are all seen."""
    path = tmp_path / "tpify" / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert expected in [name for _, name in tpify_imports(path, tmp_path / "tpify")]
