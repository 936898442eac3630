#!/usr/bin/env bash
# llama.cpp for benchmark/compare_llamacpp.py only; never an lmd dependency.
#
#   bash benchmark/setup_llamacpp.sh            # llama-cpp-python + llama-server (~25 min on 2 cores)
#   bash benchmark/setup_llamacpp.sh --no-server
#
# 1. downloads the llama-cpp-python source package into $LMD_LLAMACPP_DIR (default
#    ~/.cache/lmd/llama.cpp) and pip-installs it built for this CPU (-DGGML_NATIVE=ON);
# 2. builds llama-server (continuous batching over parallel slots) with CMake from the
#    llama.cpp sources that package vendors, into $LMD_LLAMACPP_DIR/build/bin.
# Nothing lands in the repository. Set LLAMA_CPP_PYTHON_VERSION to pin another release.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${LMD_LLAMACPP_DIR:-$HOME/.cache/lmd/llama.cpp}"
JOBS="${JOBS:-$(nproc)}"
BUILD_SERVER=1
[[ "${1:-}" == "--no-server" ]] && BUILD_SERVER=0

mkdir -p "$ROOT"
cd "$ROOT"
SDIST="llama_cpp_python-${VERSION}.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    # --no-binary for this package only: its build dependencies (cmake, ninja) come as wheels
    pip download "llama-cpp-python==${VERSION}" --no-deps --no-binary llama-cpp-python -d "$ROOT"
fi

echo "[setup_llamacpp] pip install $SDIST (compiles llama.cpp; GGML_NATIVE=ON)"
# LLAVA_BUILD=OFF: the multimodal library is not benchmarked and doubles the build
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
    nice -n 10 pip install --no-deps "$ROOT/$SDIST"
# llama-cpp-python's runtime dependencies, if missing (numpy is already an lmd dependency)
pip install 'typing-extensions>=4.5' 'diskcache>=5.6.1' 'jinja2>=2.11.3' >/dev/null
python -c "import llama_cpp; print('[setup_llamacpp] llama_cpp', llama_cpp.__version__)"

if [[ "$BUILD_SERVER" == 1 ]]; then
    SRC="$ROOT/llama_cpp_python-${VERSION}"
    [[ -d "$SRC" ]] || tar xzf "$SDIST"
    echo "[setup_llamacpp] building llama-server from $SRC/vendor/llama.cpp"
    # static libs, no tests/examples, no web UI download (the benchmark talks JSON over HTTP)
    nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    nice -n 10 cmake --build "$ROOT/build" --target llama-server -j "$JOBS"
    echo "[setup_llamacpp] llama-server: $ROOT/build/bin/llama-server"
fi
