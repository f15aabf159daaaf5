"""The command line lives in tpify.cli, apart from the library core: ``import tpify`` imports
none of it, matplotlib (the ``cli`` extra) is imported only to plot, and the wheel ships the
default fine-tuning text inside tpify/cli/data/."""

import subprocess
import sys
from pathlib import Path

import pytest

import tputil
from tpify.cli import finetune as ft


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.slow  # a fresh interpreter per check: about 5 s
def test_core_imports_no_cli_and_no_matplotlib():
    loaded = _run("import sys, tpify, tpify.integrations\n"
                  "print(sorted(m for m in sys.modules if m.startswith(('tpify.cli', 'matplotlib'))))")
    assert loaded.strip() == "[]", loaded
    loaded = _run("import sys, tpify.cli, tpify.cli.finetune, tpify.cli.demo_models, tpify.cli.launch\n"
                  "print('matplotlib' in sys.modules)")
    assert loaded.strip() == "False", "matplotlib must be imported only when the loss curve is plotted"


@pytest.mark.slow
def test_python_m_tpify_cli_runs_main():
    """torchrun starts the ranks as ``python -m tpify.cli ...`` (tpify/cli/__main__.py)."""
    out = subprocess.run([sys.executable, "-m", "tpify.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "finetune" in out.stdout and "embed" in out.stdout


def test_default_text_ships_with_the_cli():
    (path,) = ft.default_text_files()
    assert path.parent == Path(ft.__file__).resolve().parent / "data"
    assert "GNU GENERAL PUBLIC LICENSE" in path.read_text(encoding="utf-8")


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r'pip install "tpify\[cli\]"'):
        ft._plot([1.0, 0.5], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()


def test_finetune_checks_for_matplotlib_before_training(monkeypatch):
    ft._require_matplotlib()  # installed with the test extra
    monkeypatch.setattr(ft.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r'pip install "tpify\[cli\]"'):
        ft._require_matplotlib()
    with pytest.raises(ImportError, match=r'needs peft.*pip install "tpify\[peft\]", or pass --lora-r 0'):
        ft._require_peft()  # LoRA is tpify finetune's default


def test_wheel_ships_the_cli_package_and_its_text(tmp_path):
    zf = tputil.build_wheel(tmp_path)
    names = set(zf.namelist())
    assert {"tpify/cli/__init__.py", "tpify/cli/__main__.py", "tpify/cli/finetune.py", "tpify/cli/launch.py",
            "tpify/cli/demo_models.py", "tpify/cli/data/gpl-3.0.txt"} <= names
    assert not any(n.startswith("tpify/data/") for n in names)
    assert not {"tpify/finetune.py", "tpify/convert.py", "tpify/launch.py", "tpify/cli.py"} & names
    meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: matplotlib")]
    assert requires and all("extra ==" in line for line in requires), requires  # never a core dependency
    assert any("extra == 'cli'" in line or 'extra == "cli"' in line for line in requires), requires
