#!/usr/bin/env bash
# The kernel library's and TurboMind's extensions built with AddressSanitizer + UndefinedBehaviorSanitizer, and the
# C++-facing tests run against it: every kernel against its reference, the model, the block
# manager, the sampler and the engine thread. Any heap overflow, use-after-free or undefined
# behaviour aborts the run with a report.
#   bash tools/sanitize.sh [extra pytest args]      (build: build/sanitize, ~5 min at -O1 on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${LMD_SANITIZE_BUILD:-build/sanitize}
cmake -S . -B "$BUILD" -DLMD_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -Dpybind11_DIR="$(python -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v python)" >/dev/null
cmake --build "$BUILD" -j "$(nproc)"
# Python is not instrumented, so the runtimes load first; leaks are not checked (the
# interpreter and torch keep memory to exit by design).
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LMD_KERNELS_EXT="$PWD/$(ls "$BUILD"/_kernels*.so)" LMD_TURBOMIND_EXT="$PWD/$(ls "$BUILD"/_turbomind*.so)"
tests=(tests/test_native_kernels.py tests/test_quant_kernels.py tests/test_kv_quant.py tests/test_turbomind_model.py
       tests/test_turbomind_engine.py tests/test_tm_block_manager.py tests/test_tm_scheduler.py tests/test_tm_sampler.py tests/test_gemm_kernels.py
       tests/test_thread_pool.py tests/test_q8_activation_kernels.py tests/test_gguf_kernels.py
       tests/test_turbomind_w4a8.py::test_int8_activations_close_to_hf_and_invariant
       tests/test_deepseek.py::test_latent_attention_kernel_matches_reference
       tests/test_deepseek.py::test_turbomind_teacher_forced_logits_match_hf
       tests/test_gpt_oss.py::test_turbomind_teacher_forced_logits_match_hf tests/test_olmo_glm.py
       tests/test_prompt_logprobs.py tests/test_speculative.py tests/test_tm_speculative.py tests/test_tm_draft.py
       tests/test_draft_length.py tests/test_lora_kernel.py tests/test_tm_lora.py tests/test_argmax_kernel.py)
# The build is -O1 (CMakeLists.txt), where GCC does not contract scalar a * b + c into FMAs as it does
# from -O2, so results move in the last bits. The one quality gate in the list, int8 KV's greedy
# agreement with the float cache over 64 tokens, is a property of the release build (the main suite
# checks it there); here its engine runs under the sanitizers through test_kv_quant's other tests.
skip=(--deselect 'tests/test_kv_quant.py::test_smollm2_greedy_tokens_through_the_engine[8]')
# --capture=sys: a sanitizer report (written to fd 2) reaches the log instead of pytest's capture
python -m pytest -q -p no:cacheprovider --capture=sys "${skip[@]}" "${tests[@]}" "$@"
