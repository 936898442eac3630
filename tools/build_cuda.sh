#!/usr/bin/env bash
# Compile the kernel library's CUDA half with the installed nvcc: every csrc/cuda/*.cu and the
# `cuda` bindings, linked into lmd.kernels._kernels, in build/cuda (or $LMD_CUDA_BUILD_DIR).
# CI runs it on machines without a GPU, so a CUDA compile error fails CI; nothing here runs a kernel.
#   bash tools/build_cuda.sh                    (sm_80, 86, 89, 90 and 90a, as a release build)
#   CUDA_ARCHS=90 bash tools/build_cuda.sh      (one architecture: faster)
# To install lmd with the CUDA half instead: pip install . -C cmake.define.LMD_WITH_CUDA=ON
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${LMD_CUDA_BUILD_DIR:-build/cuda}
PY=${PYTHON:-python3}
command -v nvcc >/dev/null || { echo "build_cuda.sh: nvcc not found" >&2; exit 1; }
args=(-S . -B "$BUILD" -DLMD_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release
      -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$PY")")
[ -n "${CUDA_ARCHS:-}" ] && args+=(-DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS")
command -v ninja >/dev/null && args+=(-G Ninja)
t0=$SECONDS
cmake "${args[@]}" > "$BUILD.configure.log" 2>&1 || { cat "$BUILD.configure.log" >&2; exit 1; }
cmake --build "$BUILD" --target _kernels -j "${JOBS:-$(nproc)}"
echo "build_cuda.sh: lmd.kernels._kernels with CUDA built in $BUILD in $((SECONDS - t0)) s"
