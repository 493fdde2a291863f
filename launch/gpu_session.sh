#!/usr/bin/env bash
# One step of a GPU session, run ON the GPU machine from the checkout's root (docs/operations.md, "A GPU session"):
# installs the wheelhouse that launch/wheelhouse.sh --peer made here beforehand (.wheelhouse/, carried), then
#   tests           the CUDA tests (tests/test_cuda.py: bfloat16 and float32), made to fail rather than skip
#                   if torch sees no GPU; the figures they print reach tests.log as captured output (-rA, no -s:
#                   under -n, what workers print straight out is lost)
#   llama3-8b       bench/gpu.py at full size: 8 layers, 256 x 2048 tokens
#   qwen3-30b-a3b   bench/gpu.py at full size: 2 layers, 128 experts, 128 x 2048 tokens
#                   (each fits one 10-minute device call: see `all` for the times measured)
#   durability      bench/gpu.py --durability --skip-peer on the Llama: auto against 0
#   memory          bench/gpu.py --memory-trace on the Llama at 16 x 2048: where each side's peak GPU memory was
#   all             the figures within one 10-minute call: the Llama with the peer then --durability (to 320 s),
#                   the Qwen3-MoE with the peer (to 590 s); each cut off at its deadline. Then `tests -n 8` as a
#                   second call. As measured on an H100 (2026-11-26): a start 30 s; the Llama's models 22 s, ours
#                   72 s a run, the peer's 123 s; the Qwen3-MoE's models 17 s, ours 37 s; `tests -n 8` 142 s
# Arguments after the step go to pytest or bench/gpu.py (`llama3-8b --samples 64`). Logs go to $OUT (the device tool's folder that comes back), else /tmp/gpu-session.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-session}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network there: never wait on the hub
PY="${PYTHON:-python3}"
step="${1:?usage: launch/gpu_session.sh tests|llama3-8b|qwen3-30b-a3b|durability|all [more arguments for it]}"
shift

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU", "transformers",
transformers.__version__)'
wanted=(elastic-oneshot)
ls .wheelhouse/llmcompressor-*.whl >/dev/null 2>&1 && wanted+=(llmcompressor)
if ! "$PY" -m pip install -q --no-index --find-links .wheelhouse "${wanted[@]}" >"$OUT/install.log" 2>&1; then
    echo "the resolving install failed (see install.log); installing the wheels as they are (--no-deps)"
    "$PY" -m pip install -q --no-index --no-deps .wheelhouse/*.whl >>"$OUT/install.log" 2>&1 || {
        tail -20 "$OUT/install.log"; exit 1; }
fi
"$PY" -m pip check 2>&1 | grep -v "^No broken" | sed 's/^/pip check: /' | head -10
"$PY" -c 'import elastic_oneshot, compressed_tensors; print("elastic_oneshot from", elastic_oneshot.__file__)'

case "$step" in
    tests) ELASTIC_ONESHOT_TEST_DEVICE="${ELASTIC_ONESHOT_TEST_DEVICE:-cuda}" "$PY" -m pytest -q -rA \
        -p no:cacheprovider --durations=0 tests/test_cuda.py "$@" 2>&1 | tee "$OUT/tests.log" \
        | grep -E "codes identical|peak GPU|committed layers|passed|failed|skipped|PASSED|FAILED|SKIPPED|ERROR|Error|^E " ;;
    llama3-8b|qwen3-30b-a3b) "$PY" bench/gpu.py --only "$step" --workdir /tmp/bench-gpu "$@" 2>&1 \
        | tee "$OUT/bench-$step.log" | grep -v "Writing model shards" ;;
    memory) "$PY" bench/gpu.py --only llama3-8b --samples 16 --memory-trace --workdir /tmp/bench-gpu "$@" 2>&1 \
        | tee "$OUT/bench-memory.log" | grep -v "Writing model shards" ;;
    durability) "$PY" bench/gpu.py --only llama3-8b --durability --skip-peer --workdir /tmp/bench-gpu "$@" 2>&1 \
        | tee "$OUT/bench-durability.log" | grep -v "Writing model shards" ;;
    all) start=$SECONDS
        step_until() { local until=$1; shift; timeout $((until - (SECONDS - start))) bash "$0" "$@"
            echo "== $1: exit $? at $((SECONDS - start)) s"; }
        step_until 320 llama3-8b --durability
        step_until 590 qwen3-30b-a3b ;;
    *) echo "unknown step $step"; exit 2 ;;
esac
