#!/usr/bin/env bash
# The GPU check (issue 13), one script, a few minutes on one H100 or H200 with the
# machine's own torch (2.11, CUDA 13): the project is not installed, it runs from this
# tree (PYTHONPATH), and the few packages the device image lacks travel as wheels.
#
#   make gpu-wheels                 # here, once: .whl/ with the lock's msgspec, pyzmq, structlog
#   device run: carry [".whl"], command "bash bench/gpu_check.sh", timeout_s 540
#
# 1. the gpu-marked tests (tests/kernels/test_kernels_gpu.py: paged attention, MoE, norm,
#    rotary and a short engine generate on CUDA, fp32 and bf16, against the CPU);
# 2. bench/gpu_decode.py: bf16 decode at 1 and 64 sequences against the weight-bytes /
#    copy-bandwidth floor.
# 3. the same with --compile (engine/compiled.py: torch.compile of the decode forward,
#    Inductor; no CUDA graphs yet), its compile time in the output.
# Output under $OUT (the device tool brings it back) or /tmp/gpu-check. The steps' time
# limits (150 + 140 + 170 s) keep the whole script inside 8 minutes, wheel install included.
set -u -o pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
start=$(date +%s)
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/gpu_env.txt"
rc=0
echo "== 1. gpu-marked tests"
timeout 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kernels_gpu.py 2>&1 \
    | tee "$OUT/gpu_tests.txt" || rc=1
echo "== 2. bf16 decode vs the bandwidth floor"
timeout 140 $PY -m bench.gpu_decode --conc 1,64 --json "$OUT/gpu_decode.json" 2>&1 \
    | tee "$OUT/gpu_decode.txt" || rc=1
echo "== 3. compiled decode forward (torch.compile)"
timeout 170 $PY -m bench.gpu_decode --conc 1,64 --compile --json "$OUT/gpu_decode_compiled.json" 2>&1 \
    | tee "$OUT/gpu_decode_compiled.txt" || rc=1
echo "gpu_check: rc=$rc in $(( $(date +%s) - start )) s"
exit $rc
