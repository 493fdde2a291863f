#!/usr/bin/env bash
# A GPU session in one device call, run ON the GPU machine from the checkout's root (docs/operations.md, "A GPU
# session"): bash launch/gpu_session.sh all, carrying .wheelhouse/ (launch/wheelhouse.sh --peer, made here before).
# One setup (the wheels installed into the work folder), then each step under its own deadline, in this order:
#   qwen3-30b-a3b   bench/gpu.py: ours, then the peer; 2 layers of 128 experts, 128 x 2048 tokens
#   llama3-8b       bench/gpu.py: ours, then the peer; 8 layers, 128 x 2048 tokens
#   memory          bench/gpu.py --memory-trace on the Llama at 16 x 2048: where each side's peak is (if time is left)
#   tests           tests/test_cuda.py with -n 8, each test under pytest-timeout, failing rather than skipping
#                   without a GPU (if time is left)
# Each step ends by its deadline (a share of --budget, 420 s: whatever happens, the call ends within it, leaving the
# session's 15 minutes of device time room for the machine's start and one more call); a step cut off is recorded
# as such and the next one starts. Under $OUT (the device tool's folder that comes back; at most 8 files):
# session.log (all of it), install.log, one log per step, and result.json: each model's figures, rewritten after
# each side, and each step's exit and seconds. Everything else goes to the work folder ($WORK, default
# /tmp/gpu-session): the wheels installed, models, states, checkpoints, caches.
#
#   bash launch/gpu_session.sh all [--tiny] [--budget SECONDS]
#   bash launch/gpu_session.sh recipes [--tiny] [--budget SECONDS]   # issue 46's recipes instead, in one call
#       (budget 520 s): tests/test_cuda.py -k 'recipes or budget or cache', then one bench/gpu.py on the Llama cut to 4 layers, 32 x 2048
#       tokens, for sparse_2of4_fp8 nvfp4 awq_w4a16_asym smoothquant_w8a8 fp8_dynamic in that order (each side's
#       figures in result.json as it ends; a recipe that fails is reported and the next one runs)
#   bash launch/gpu_session.sh STEP [arguments for bench/gpu.py, or for pytest with tests]   # one step, no deadline
#   (STEP: one of the four, or durability: ours on the Llama with --boundary-every auto against 0)
#
# --tiny: the same steps on CPU with tiny shapes and few tokens (tests/test_gpu_session.py runs it in CI).
set -uo pipefail
cd "$(dirname "$0")/.."
WORK="${WORK:-/tmp/gpu-session}"
OUT="${OUT:-$WORK/out}"
mkdir -p "$OUT" "$WORK/tmp"
# bytecode cached in the work folder, not beside the sources: the first process compiles the wheels installed
# without it (--no-compile) and the checkout, and every later one, ours or the peer's, starts as a user's would
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONPYCACHEPREFIX="$WORK/pycache"
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1  # no network there: never wait on the hub
export HF_HOME="$WORK/hf" XDG_CACHE_HOME="$WORK/cache" TMPDIR="$WORK/tmp" TRITON_CACHE_DIR="$WORK/triton" \
    MPLCONFIGDIR="$WORK/mpl"  # nothing written outside $OUT and $WORK
PY="${PYTHON:-python3}"
export WORK OUT PY
step="${1:?usage: launch/gpu_session.sh all|recipes [--tiny] [--budget SECONDS] | qwen3-30b-a3b|llama3-8b|memory|tests [args]}"
shift

setup() {  # [SECONDS]: the wheels of .wheelhouse/ (exact versions, resolved against the image by wheelhouse.sh)
    # into $WORK/site, within SECONDS
    local limit=${1:-600}
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    if [ -z "${TINY:-}" ] && ls .wheelhouse/*.whl >/dev/null 2>&1; then  # (--tiny: the wheels are the GPU machine's)
        wheels=(); for w in .wheelhouse/*.whl; do [[ "$(basename "$w")" == elastic_oneshot-* ]] || wheels+=("$w"); done
        timeout -k 3 "$limit" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "${wheels[@]}" >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
        export PYTHONPATH="$PYTHONPATH:$WORK/site"
        echo "installed ${#wheels[@]} wheels from .wheelhouse into $WORK/site"
    else
        echo "this environment as it is (no .wheelhouse/, or --tiny; launch/wheelhouse.sh --peer brings the peer)" \
            | tee "$OUT/install.log"
    fi
    timeout -k 3 "$limit" "$PY" -c 'import sys, torch, transformers, compressed_tensors, importlib.util as u
print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU", "transformers", transformers.__version__,
      "llmcompressor", "yes" if u.find_spec("llmcompressor") else "no")' || echo "(the versions' check: exit $?)"
}

imports() {  # the seconds `import elastic_oneshot.surface.api` takes there (-X importtime), the first time (which
    # compiles the bytecode into $WORK/pycache) and again, with its largest top-level imports
    for run in first again; do
        "$PY" -X importtime -c 'import elastic_oneshot.surface.api' 2>"$WORK/importtime-$run.txt" || return 0
    done
    "$PY" - "$WORK"/importtime-first.txt "$WORK"/importtime-again.txt <<'PYTHON'
import sys
for path, run in zip(sys.argv[1:], ("first", "again")):
    total, packages = 0.0, []  # packages: each top-level one where first imported (nested in another's time)
    for line in open(path):
        fields = line.removeprefix("import time:").split("|")
        if len(fields) == 3 and fields[1].strip().isdigit():
            seconds, name = int(fields[1]) / 1e6, fields[2].strip()
            total += seconds if not fields[2][1:].startswith(" ") else 0
            if "." not in name and not name.startswith("_") and name != "elastic_oneshot":
                packages.append((seconds, name))
    print(f"imports ({run}): {total:.2f} s; " + ", ".join(f"{n} {t:.2f}" for t, n in sorted(packages)[::-1][:6]))
PYTHON
}

bench() {  # NAME LOG [bench/gpu.py arguments]
    local name=$1 log=$2; shift 2
    "$PY" bench/gpu.py --only "$name" --workdir "$WORK/bench" --log "$OUT/$log" --result "$OUT/result.json" "$@" \
        2>&1 | grep -v "Writing model shards"
}

tests() {
    "$PY" -m pytest -q -rA -p no:cacheprovider --durations=0 tests/test_cuda.py "$@" 2>&1 | tee -a "$OUT/tests.log" \
        | grep -E "codes identical|peak GPU|committed layers|passed|failed|skipped|PASSED|FAILED|SKIPPED|ERROR|Error|^E "
}

record() {  # STEP EXIT START_S END_S DEADLINE_S: the step's outcome into result.json
    "$PY" - "$OUT/result.json" "$@" <<'PYTHON'
import json, os, sys
path, step, code, start, end, deadline = sys.argv[1:]
try:
    data = json.load(open(path))
except (OSError, ValueError):
    data = {}
data.setdefault("steps", []).append({"step": step, "exit": int(code), "cut_off": int(code) in (124, 137),
                                     "start_s": int(start), "end_s": int(end), "deadline_s": int(deadline)})
json.dump(data, open(path + ".tmp", "w"), indent=1)
os.replace(path + ".tmp", path)
PYTHON
}

case "$step" in
    all|recipes)
        budget=$([ "$step" = all ] && echo 420 || echo 520) tiny=()
        while [ $# -gt 0 ]; do
            case "$1" in
                --tiny) tiny=(--tiny); shift ;;
                --budget) budget=$2; shift 2 ;;
                *) echo "all takes --tiny and --budget SECONDS, not $1" >&2; exit 2 ;;
            esac
        done
        exec > >(tee -a "$OUT/session.log") 2>&1
        rm -f "$OUT/result.json"
        start=$SECONDS
        # name, deadline in thousandths of the budget, command (the deadlines are end times: time a step leaves
        # goes to the next)
        if [ ${#tiny[@]} -gt 0 ]; then  # on CPU: tiny shapes, few tokens; the CUDA tests on the CPU
            export CUDA_VISIBLE_DEVICES="" ELASTIC_ONESHOT_TEST_DEVICE=cpu TINY=1
            sizes=(--tiny --samples 4 --seq-len 64) trace=(--tiny --samples 4 --seq-len 64 --memory-trace) workers=2
        else
            export ELASTIC_ONESHOT_TEST_DEVICE=cuda  # the CUDA tests fail rather than skip without a GPU
            sizes=(--samples 128) trace=(--samples 16 --memory-trace) workers=8
        fi
        if [ "$step" = all ]; then
            steps=(
                "setup 150 setup"
                "qwen3-30b-a3b 560 bench qwen3-30b-a3b qwen3-30b-a3b.log ${sizes[*]}"
                "llama3-8b 915 bench llama3-8b llama3-8b.log ${sizes[*]}"
                "memory 965 bench llama3-8b memory.log ${trace[*]}"
                "tests 990 tests -n $workers --timeout 240"
            )
        else  # the tests first (does each recipe run on the GPU, against the peer), then the costlier benches
            [ ${#tiny[@]} -gt 0 ] && cut=(--tiny --samples 4 --seq-len 64) || cut=(--layers 4 --samples 32)
            recipes=(--recipe sparse_2of4_fp8 --recipe nvfp4 --recipe awq_w4a16_asym --recipe smoothquant_w8a8
                     --recipe fp8_dynamic)
            steps=(
                "setup 100 setup"
                "tests 250 tests -n $workers --timeout 150 -k 'recipes or budget or cache'"
                "recipes 1000 bench llama3-8b recipes.log ${cut[*]} ${recipes[*]}"
            )
        fi
        for s in "${steps[@]}"; do
            read -r name share cmd <<<"$s"
            begun=$((SECONDS - start)) deadline=$((budget * share / 1000))
            left=$((deadline - begun))
            echo "== $name: from $begun s, deadline $deadline s"
            if [ $left -lt 5 ]; then
                echo "== $name: no time left"; record "$name" 124 "$begun" "$begun" "$deadline"; continue
            fi
            if [ "$name" = setup ]; then  # in this shell: its PYTHONPATH is the steps'
                setup "$((left - 2))"; code=$?
                rest=$((deadline - SECONDS + start))
                [ $code = 0 ] && [ $rest -gt 2 ] && timeout -k 3 "$rest" bash -c "$(declare -f imports); imports"
            else
                timeout -k 3 "$left" bash -c "$(declare -f bench tests); $cmd" _; code=$?
            fi
            echo "== $name: exit $code at $((SECONDS - start)) s$([ $code = 124 ] && echo ' (cut off at its deadline)')"
            record "$name" "$code" "$begun" "$((SECONDS - start))" "$deadline"
            [ "$name" = setup ] && [ $code != 0 ] && { echo "setup failed: no step can run"; exit 1; }
        done
        echo "== session: $((SECONDS - start)) s of $budget; result.json:"
        cat "$OUT/result.json"; echo ;;
    setup) setup ;;
    qwen3-30b-a3b|llama3-8b) setup && bench "$step" "$step.log" "$@" ;;
    memory) setup && bench llama3-8b memory.log --samples 16 --memory-trace "$@" ;;
    durability) setup && bench llama3-8b durability.log --durability --skip-peer "$@" ;;
    tests) setup && ELASTIC_ONESHOT_TEST_DEVICE="${ELASTIC_ONESHOT_TEST_DEVICE:-cuda}" tests "$@" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
esac
