#!/usr/bin/env bash
# One command on a lent GPU machine, at most 10 minutes on one H100 (docs/benchmarks.md, "GPU check"):
#
#   bash benchmarks/gpu_check.sh [OUT] [gpu_check.py options]      (OUT default: benchmarks/out/gpu_check)
#
# 1. Installs the wheels of .whl/ (made here by benchmarks/gpu_wheels.sh, carried to the GPU
#    machine) with --no-deps into .gpu_site/, ahead of the image's packages on PYTHONPATH: never
#    torch (the image's stays); a wheel this Python cannot take is skipped (the image's copy stays).
# 2. Runs benchmarks/gpu_check.py with this checkout's tpify in the time left: OUT/gpu_check.json
#    and OUT/gpu_check.md, rewritten after every section (a timeout keeps what was done).
set -uo pipefail
start=$SECONDS
cd "$(dirname "$0")/.."
out=${1:-benchmarks/out/gpu_check}
shift || true
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf .gpu_site
  if ! python -m pip install --quiet --no-deps --no-index --no-compile --target .gpu_site .whl/*.whl \
       > "$out/wheels.log" 2>&1; then
    for wheel in .whl/*.whl; do  # one at a time: those this Python takes
      python -m pip install --quiet --no-deps --no-index --no-compile --target .gpu_site --upgrade "$wheel" \
        >> "$out/wheels.log" 2>&1 || echo "gpu_check: skipped $(basename "$wheel") (not for this Python)"
    done
  fi
  export PYTHONPATH="$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "gpu_check: no .whl/ (bash benchmarks/gpu_wheels.sh makes it): the image's own packages are used"
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# kernels in launch order, so the column-parallel all-reduce runs beside the weight-gradient GEMM (docs/gpu.md)
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
budget=$(( 585 - (SECONDS - start) ))
versions=$(python -c 'import torch, transformers as t; print("torch", torch.__version__, "transformers",
t.__version__)')
echo "gpu_check: $versions; ${budget} s left"
exec python benchmarks/gpu_check.py --out "$out" --budget "$budget" "$@"
