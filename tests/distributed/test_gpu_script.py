"""docs/gpu_train.py, the GPU guide's script (docs/gpu.md), run as the guide runs it: ``torchrun
--nproc-per-node 2`` (one process per GPU; here, without a GPU, the same script on the CPU over
gloo; with ``TPIFY_TEST_DEVICE=cuda`` and two GPUs, on them over NCCL). Each rank sets its device
from ``LOCAL_RANK``, parallelizes, trains 3 AdamW steps with clipping; the loss and the norm are
finite and rank 0 reports tp 2 on the expected device."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tputil

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "gpu_train.py"


@pytest.mark.slow  # about 20 s: torchrun and two ranks importing transformers
def test_the_gpu_guides_script_trains_tp2_with_one_process_per_device():
    cuda = tputil.device_kind() == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        pytest.skip("one process per GPU needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH", "")]))
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU suite: the script takes its CPU branch
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(SCRIPT)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = re.findall(r"step (\d): loss ([\d.]+), grad norm ([\d.]+), tp (\d), world (\d), device (\S+)", out.stdout)
    assert [s[0] for s in steps] == ["0", "1", "2"], out.stdout
    assert all(math.isfinite(float(s[1])) and math.isfinite(float(s[2])) for s in steps)
    assert {(s[3], s[4], s[5]) for s in steps} == {("2", "2", "cuda:0" if cuda else "cpu")}, steps
