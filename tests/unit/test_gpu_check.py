"""benchmarks/gpu_check.py, the GPU check, run where there is no GPU: every section's code path at
toy sizes on the CPU (``--device cpu --quick``), as the GPU run takes it at full size; and its
report's tables from the results of a run.

What it proves: the one command writes ``gpu_check.json`` and ``gpu_check.md`` with every
section ``ok``; at tp = 2 on two gloo ranks the fp32, autocast, chunked-loss and expert-parallel
losses and gradients are within their tolerances of the dense model's, sequence parallelism with
dropout draws other attention masks per rank from per-rank streams (the shared stream equal);
the mesh (and FSDP2's parameters) are on the CPU here for every backend string tried; the
tp = 1 losses equal plain HF's; the graph breaks are counted.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_tables_show_each_section_its_status_and_the_rows_it_recorded():
    gc = _module()
    report = {"mode": "--device cuda", "sections": {
        "env": {"status": "ok", "seconds": 1.0, "results": {"versions": {"torch": "2.11"}, "card": {"name": "H100"}}},
        "two_ranks": {"status": "timeout after 130 s (results so far kept)", "seconds": 130.0, "results": {
            "setup": {"ranks": 2}, "fp32 (TF32 off)": {"ok": True, "tolerance": 1e-4, "grad rel err (max)": 2e-7},
            "log tail": "killed"}},
        "tp1_overhead": {"status": "ok", "seconds": 9.0, "results": {"gpt2 124M, bf16": {
            "dense": {"first loss": 10.9, "step ms": 50.0, "peak MiB": 3000.0, "host syncs per step": 0},
            "tpify": {"first loss": 10.9, "step ms": 51.0, "peak MiB": 3010.0, "host syncs per step": 2},
            "tokens": 8192, "loss rel diff": 0.0, "step ratio": 1.02, "parameters (M)": 124.4}}}}}
    text = gc.markdown(report)
    assert "## two_ranks: timeout after 130 s (results so far kept), 130.0 s" in text
    assert "| fp32 (TF32 off) | True | 0.0001 | 2e-07 |" in text, text  # only the columns a row has
    row = "| gpt2 124M, bf16 | 124 | 8192 | 10.9 | 10.9 | 0 | 50 | 51 | 1.02 | 3e+03 | 3.01e+03 | 0 | 2 |"
    assert row in text, text
    assert "| torch | 2.11 |" in text and "setup: ranks 2" in text


@pytest.mark.slow
def test_every_section_of_the_gpu_check_runs_on_the_cpu_in_quick_mode(tmp_path):
    """About 2.5 minutes on 2 CPU cores."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert {name: s["status"] for name, s in sections.items()} == {name: "ok" for name in _module().SECTIONS}, \
        json.dumps(sections, indent=1)[-4000:]
    two = sections["two_ranks"]["results"]
    checks = {k: v for k, v in two.items() if k != "setup"}
    assert len(checks) == 5 and all(v["ok"] for v in checks.values()), json.dumps(two, indent=1)
    sp = two["sequence parallel + dropout 0.1: per-rank streams"]
    assert sp["attention masks differ"] and sp["TP stream (cpu) differs"] and sp["default stream (cpu) equal"]
    mesh = sections["mesh_device"]["results"]
    assert mesh and all(r.get("mesh device") == "cpu" and r["parameters after FSDP2"] == ["cpu"]
                        for r in mesh.values()), mesh
    tp1 = sections["tp1_overhead"]["results"]
    assert len(tp1) == 4 and all(r["loss equal (rel 1e-2, bf16)"] for r in tp1.values()), tp1
    compiled = sections["compile"]["results"]
    assert all(isinstance(r["graph breaks"], int) for r in compiled.values()), compiled
    loss = sections["chunked_loss"]["results"]
    assert loss["tpify chunked"]["loss rel diff"] < 1e-2, loss
    quantized = {k: v for k, v in sections["quantized"]["results"].items() if k != "setup"}
    assert len(quantized) == 4 and all(r["ok"] and r["dequantized shard bitwise equal"] for r in quantized.values()), \
        quantized
    md = (tmp_path / "gpu_check.md").read_text()
    assert all(f"## {name}: ok" in md for name in sections), md
