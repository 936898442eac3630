#!/usr/bin/env bash
# lmd on an NVIDIA GPU, in one prepared run (the GPU machines here are lent for minutes):
#   1. what the machine is (GPU, driver, nvcc, torch, triton),
#   2. lmd built and installed there with its CUDA half for sm_90/sm_90a (editable, no network:
#      --no-deps --no-build-isolation),
#   3. tests/test_cuda_*.py: the kernel library's CUDA kernels against their CPU references;
#      tests/test_gpu.py: the PyTorch engine's Triton kernels compiled for the GPU against the torch
#      kernels on the CPU, tiny models of every architecture against HF transformers float32, the
#      engine end to end (greedy = HF, batch = alone, prefix hit = miss),
#   4. benchmark/gpu_decode.py: decode tok/s of the PyTorch engine beside transformers on the GPU.
# Every step has its own time limit and log; the summary is $OUT/gpu_check.json (also printed last).
#   bash tools/gpu_check.sh                  (OUT defaults to build/gpu_check)
#   GPU_CHECK_QUICK=1 bash tools/gpu_check.sh   (tiny benchmark model: a smoke run)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
STEPS="$OUT/steps.tsv"
: > "$STEPS"

# step NAME LIMIT_S CMD...: runs CMD under a time limit, its output in $OUT/NAME.log
step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEPS"
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 5 "$OUT/$name.log"
    return $rc
}

step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader;
    nvcc --version | tail -n 2; $PY -c 'import torch, triton, transformers, sys;
print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__,
      torch.cuda.get_device_name(), torch.cuda.get_device_capability())'"

if step build 150 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . \
        -C cmake.define.LMD_WITH_CUDA=ON -C cmake.define.CMAKE_CUDA_ARCHITECTURES=90 ; then
    step import 20 "$PY" -c 'import lmd.kernels, lmd.turbomind, lmd.pytorch_backend; print(lmd.kernels.cpu_features());
print("cuda kernels:", lmd.kernels.cuda and lmd.kernels.cuda.compiled_archs(), lmd.kernels.cuda and lmd.kernels.cuda.device_count())'
    step cuda_tests 130 "$PY" -m pytest -q -rfs -p no:cacheprovider --junitxml="$OUT/cuda_tests.xml" tests/test_cuda_*.py
    step tests 180 "$PY" -m pytest -q -rfs -p no:cacheprovider --junitxml="$OUT/tests.xml" tests/test_gpu.py
    preset=llama-1b; [ -n "${GPU_CHECK_QUICK:-}" ] && preset=tiny
    step bench 75 bash -c "$PY benchmark/gpu_decode.py --preset $preset --batch 1 16 --prompt-len 128 --new 64 \
        > $OUT/bench.json"
fi

"$PY" - "$OUT" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
summary = {'steps': {}}
for line in open(os.path.join(out, 'steps.tsv')):
    name, rc, secs = line.rstrip('\n').split('\t')
    summary['steps'][name] = {'rc': int(rc), 'seconds': int(secs)}
env_log = open(os.path.join(out, 'env.log')).read().strip().splitlines()
summary['env'] = env_log[-4:]
for name in ('cuda_tests', 'tests'):
    xml = os.path.join(out, name + '.xml')
    if not os.path.exists(xml):
        continue
    suite = ET.parse(xml).getroot().find('testsuite')
    failed = [f"{c.get('classname')}::{c.get('name')}: {(c.find('failure') if c.find('failure') is not None else c.find('error')).get('message', '')[:300]}"
              for c in suite.iter('testcase') if c.find('failure') is not None or c.find('error') is not None]
    summary[name] = {k: int(suite.get(k, 0)) for k in ('tests', 'failures', 'errors', 'skipped')}
    summary[name]['failed'] = failed[:25]
bench = os.path.join(out, 'bench.json')
if os.path.exists(bench) and os.path.getsize(bench):
    try:
        summary['bench'] = json.load(open(bench))
    except ValueError as e:
        summary['bench'] = f'unreadable: {e}'
json.dump(summary, open(os.path.join(out, 'gpu_check.json'), 'w'), indent=1)
for name in ('steps.tsv', 'cuda_tests.xml', 'tests.xml'):  # read into the summary; the device tool brings back 8 files at most
    if os.path.exists(os.path.join(out, name)):
        os.remove(os.path.join(out, name))
print(json.dumps(summary, indent=1))
EOF
