import os
import sys
from pathlib import Path

# Helpers shared by the unit and distributed tests live in tests/tputil.py.
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
