"""The tested versions are one fact written in three places: ``constraints.txt`` (what CI installs:
the versions the whole suite passed on), the README's "Tested versions" paragraph, and the lower
bounds of ``pyproject.toml`` (versions the quick subset passed on, listed in docs/tests.md's
"Versions" table). They must agree; nothing here imports the packages."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
#: The packages the README names with their tested version.
NAMED = ("torch", "transformers", "accelerate", "peft", "trl", "safetensors")


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.lower()] = version
    return pins


def _lower_bounds() -> dict[str, Version]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = [*data["project"]["dependencies"], *(r for extra in data["project"]["optional-dependencies"].values()
                                               for r in extra)]
    out = {}
    for raw in reqs:
        req = Requirement(raw)
        lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
        if lows:
            out[req.name.lower()] = max(lows)
    return out


def test_ci_installs_from_the_constraints_file():
    run = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[test]" -c constraints.txt' in run, run
    pins = _constraints()
    assert all(name in pins for name in NAMED), sorted(set(NAMED) - set(pins))


def test_readme_names_the_constrained_versions():
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("**Tested versions.**"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    pins = _constraints()
    for name in NAMED:
        assert re.search(rf"\b{name} {re.escape(pins[name])}\b", paragraph), (name, pins[name], paragraph)


def test_lower_bounds_are_versions_the_suite_ran_on():
    """Each lower bound is at most the constrained version, and is a version docs/tests.md records
    the quick subset passing on (its "Versions" table, row "lower bounds")."""
    docs = (ROOT / "docs" / "tests.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| lower bounds |"))
    tested = dict(re.findall(r"([a-z_-]+) ([0-9][0-9a-z.]*)", row.split("|")[2]))
    pins = _constraints()
    for name, low in _lower_bounds().items():
        if name in pins:
            assert low <= Version(pins[name]), (name, low, pins[name])
        if name in NAMED:
            assert name in tested and Version(tested[name]) == low, (name, low, tested)
