"""The GPU switch of the test suite (tests/tputil.py): ``TPIFY_TEST_DEVICE`` is ``cpu`` (default)
or ``cuda``; asking for ``cuda`` where torch sees no GPU, or for another value, stops the session
at collection with an error naming the fix; in ``cpu`` mode :func:`tputil.to_device` leaves
models and tensors where they are."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tputil


def test_the_test_device_is_cpu_by_default_and_to_device_moves_nothing_there(monkeypatch):
    monkeypatch.delenv(tputil.DEVICE_ENV, raising=False)
    assert tputil.device_kind() == "cpu" and tputil.device() == torch.device("cpu")
    model, x = torch.nn.Linear(2, 2), torch.zeros(3)
    assert tputil.to_device(model) is model and tputil.to_device(x) is x
    moved = tputil.to_device({"a": (x, [x]), "n": 3})
    assert moved["a"][0] is x and moved["a"][1][0] is x and moved["n"] == 3
    monkeypatch.setenv(tputil.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="TPIFY_TEST_DEVICE='gpu': use TPIFY_TEST_DEVICE=cpu .* or "
                                         "TPIFY_TEST_DEVICE=cuda"):
        tputil.device_kind()


def test_cuda_without_a_gpu_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setenv(tputil.DEVICE_ENV, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"TPIFY_TEST_DEVICE=cuda, but torch .*\(torch.cuda.is_available\(\) is "
                                         r"False\).*a machine with a GPU.*or unset TPIFY_TEST_DEVICE"):
        tputil.check_test_device()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tputil.check_test_device()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_session_with_tpify_test_device_cuda_stops_at_collection_here():
    tests = Path(tputil.__file__).resolve().parent
    env = dict(os.environ, TPIFY_TEST_DEVICE="cuda")
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(tests / "unit" / "test_versions.py")], capture_output=True, text=True, env=env,
                         cwd=tests.parent, timeout=120)
    assert out.returncode == 4, (out.returncode, out.stdout, out.stderr)  # pytest's usage error
    assert "TPIFY_TEST_DEVICE=cuda, but torch" in out.stderr and "unset TPIFY_TEST_DEVICE" in out.stderr, out.stderr
