#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on the lent GPU machine, whose image has torch (2.11)
# but an older transformers (5.17) and no Liger-Kernel: transformers, peft, accelerate,
# safetensors and what they need beyond torch, at constraints.txt's versions, and Liger-Kernel,
# downloaded into .whl/ (ignored by git; the device tool carries it: carry=[".whl"]). Never torch,
# nor what torch needs (the image's stay); numpy neither (the image has it); nor typer, which only
# transformers' command line imports.
#
# Run here, where PyPI is reachable:  bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
pins=$(python - <<'PY'
"""name==version for the closure of the packages below, at constraints.txt's pins (else the installed version)."""
import re
from importlib.metadata import PackageNotFoundError, distribution
from packaging.requirements import Requirement

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

pinned = {}
for line in open("constraints.txt"):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, version = line.split("==")
        pinned[canon(name)] = version

def closure(roots, stop=()):
    seen, todo = {}, list(roots)
    while todo:
        name = canon(todo.pop())
        if name in seen or name in stop:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        seen[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen

torch_side = set(closure(["torch"])) | {"numpy"}
# typer is transformers' command line only (and brings pydantic's per-Python binary core): not carried
wanted = closure(["transformers", "peft", "accelerate", "safetensors"], stop=torch_side | {"typer"})
print(" ".join(f"{name}=={pinned.get(name, version)}" for name, version in sorted(wanted.items())))
PY
)
echo "gpu_wheels: $pins"
python -m pip download --quiet --no-deps --only-binary=:all: --dest .whl $pins
python -m pip download --quiet --no-deps --only-binary=:all: --dest .whl liger-kernel==0.8.5 \
  || echo "gpu_wheels: no Liger-Kernel wheel: the chunked-loss section of gpu_check skips it"
# bitsandbytes (the quantized section): its wheel carries a CUDA library per CUDA version (43 MB); keep
# those of CUDA 12.6 to 13.2 so that .whl stays under the device tool's 64 MiB (the RECORD follows)
if python -m pip download --quiet --no-deps --only-binary=:all: --dest .whl/bnb "bitsandbytes==$(python -c \
    'from importlib.metadata import version; print(version("bitsandbytes"))' 2>/dev/null || echo 0.50.2)"; then
  python - <<'PY'
"""Drop the ROCm, XPU and older CUDA libraries from the bitsandbytes wheel in .whl/bnb/, into .whl/."""
import pathlib, re, zipfile
src = next(pathlib.Path(".whl/bnb").glob("bitsandbytes-*.whl"))
keep = lambda n: not n.endswith(".so") or re.search(r"cuda1(2[68]|3[0-9])\.so$", n)
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(pathlib.Path(".whl") / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if not keep(item.filename):
            continue
        data = zin.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(keepends=True) if keep(l.split(b",")[0].decode()))
        zout.writestr(item, data)
PY
  rm -rf .whl/bnb
else
  echo "gpu_wheels: no bitsandbytes wheel: the quantized section of gpu_check reports it missing"
fi
ls .whl | wc -l | xargs echo "gpu_wheels: wheels:" && du -sh .whl
