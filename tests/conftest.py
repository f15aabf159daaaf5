import os
import sys
from pathlib import Path

# Helpers shared by the unit and distributed tests live in tests/tputil.py.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    """``TPIFY_TEST_DEVICE=cuda`` without CUDA (or another value) stops the session at collection,
    naming the fix (tests/tputil.py, ``check_test_device``)."""
    import pytest

    import tputil

    try:
        tputil.check_test_device()
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
