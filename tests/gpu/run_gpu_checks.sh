#!/usr/bin/env bash
# GPU checks for the accelerator machine (device synchronization, step timing and energy on CUDA). From the
# repository root:
#
#   tests/gpu/run_gpu_checks.sh            # needs CUDA; fails if torch cannot see a GPU
#   tests/gpu/run_gpu_checks.sh --dry-run  # no GPU: the same steps on CPU with a tiny config
#   tests/gpu/run_gpu_checks.sh --help     # this text
#
# 1. the tests marked `gpu` (tests/gpu/test_gpu.py): per-step CUDA synchronization, step latencies
#    vs CUDA events of the same steps (5 %), sum of step latencies vs the request span (2 %);
#    synchronize="events": device-time step latencies vs events with a synchronize per step (2 % per
#    step from step 1, 1 % in sum), no synchronize without the reference; energy per output token
#    vs NVML read around the whole call (5 %) at batch 1 and 8, with generate() (synchronize=True
#    and "events") and generate_batch (needs nvidia-ml-py in the environment: the energy extra);
# 2. `otel-generate bench --compare --device cuda` on a random-weight Llama-architecture model of
#    about 1.1B parameters in bfloat16 (config in tests/gpu/test_gpu.py, nothing downloaded);
# 3. the same overhead comparison on the default tiny GPT-2 model on CUDA;
# 4. benchmarks/gpu_sync_split.py: that model's per-step cost split into the synchronize and the rest
#    (instrumented with synchronize on and off, against plain, interleaved);
# 5. benchmarks/gpu_events.py: the paired cost of synchronize="events" vs "wait" vs uninstrumented
#    (and events with energy), on the tiny GPT-2 and on the 1.1B Llama.
#
# Environment: PYTHON (default: python), OUT (where results go; default: a new temporary folder).
# Prints the date, the device, the versions and every result; the JSON and PNG files stay in $OUT.
set -euo pipefail
if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo pipefail/{/^#/{s/^# \{0,1\}//;p}}' "$0"
    exit 0
fi
cd "$(dirname "$0")/../.."

DRY_RUN=0
case "${1:-}" in
    --dry-run) DRY_RUN=1 ;;
    "") ;;
    *) echo "usage: $0 [--dry-run | --help]" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"

echo "=== GPU checks: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) (dry run: $DRY_RUN) ==="
echo "results in $OUT"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
"$PYTHON" - <<'EOF'
import platform, torch, transformers, otel_generate
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"otel_generate {otel_generate.__version__}")
print(f"CUDA available: {torch.cuda.is_available()}"
      + (f", device {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""))
EOF

if [ "$DRY_RUN" = 0 ]; then
    "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || {
        echo "error: torch.cuda.is_available() is False; run with --dry-run to check the script on CPU" >&2
        exit 1
    }
    DEVICE=cuda DTYPE=bfloat16 PROMPT=128 NEW=64 WARMUP=3 RUNS=10
else
    DEVICE=cpu DTYPE=float32 PROMPT=16 NEW=8 WARMUP=1 RUNS=2
fi

# --- 1. the tests marked gpu (they skip themselves without CUDA) ----------------------------------
echo
echo "=== 1. pytest -m gpu tests/gpu ==="
set +e
"$PYTHON" -m pytest -m gpu tests/gpu -v -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt"
PYTEST_RC=${PIPESTATUS[0]}
set -e
echo "pytest -m gpu exit status: $PYTEST_RC"

# --- 2. bench --compare on a ~1.1B Llama-architecture model --------------------------------------
CONFIG="$OUT/llama-config.json"
"$PYTHON" - "$CONFIG" "$DRY_RUN" <<'EOF'
import json, sys
sys.path.insert(0, "tests/gpu")
from test_gpu import LLAMA_1B_CONFIG
config = dict(LLAMA_1B_CONFIG)
if sys.argv[2] == "1":  # dry run on CPU: the same architecture, tiny
    config.update(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
with open(sys.argv[1], "w") as handle:
    json.dump(config, handle, indent=2)
EOF

summarize() {
    "$PYTHON" - "$1" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
c = doc["compare"]
print(f"model {doc['model']}: {doc['parameters'] / 1e9:.3f}B parameters, {doc['dtype']}, device {doc['device']}"
      f" ({doc['machine'].get('gpu', doc['machine']['cpu'])})")
print(f"prompt {doc['prompt_tokens']}, new tokens {doc['new_tokens_requested']}, batch {doc['batch_size']}, "
      f"warmup {doc['warmup']}, runs {doc['runs']}")
print(f"median elapsed {doc['median_elapsed_s'] * 1e3:.3f} ms, {doc['median_tokens_per_s']:.1f} tokens/s, "
      f"TTFT {doc['median_time_to_first_token_ms']:.3f} ms, TPOT {doc['median_time_per_output_token_ms']:.3f} ms")
iqr, iqr_d = c["iqr_paired_ratio"], c["iqr_paired_ratio_with_deferred"]
print(f"compare ({c['pairs']} pairs A B A B): median paired ratio instrumented/plain {c['median_paired_ratio']:.4f} "
      f"(IQR {iqr[0]:.4f} to {iqr[1]:.4f}), with deferred work {c['median_paired_ratio_with_deferred']:.4f} "
      f"(IQR {iqr_d[0]:.4f} to {iqr_d[1]:.4f}), exporter {c['exporter']}")
print(f"added {c['median_added_us_per_step']:.1f} us/step; plain {c['median_plain_elapsed_s'] * 1e3:.3f} ms, "
      f"instrumented {c['median_instrumented_elapsed_s'] * 1e3:.3f} ms; spans {c['spans_exported']}/{c['spans_expected']}; "
      f"outputs identical {c['outputs_identical']}")
print("paired ratios:", ", ".join(f"{r:.4f}" for r in c["paired_ratios"]))
for w in doc.get("warnings", []):
    print("WARNING:", w)
EOF
}

echo
echo "=== 2. otel-generate bench --compare --device $DEVICE, Llama-architecture config ($DTYPE) ==="
BENCH_1B=("$PYTHON" -m otel_generate bench --device "$DEVICE" --model-config "$CONFIG" --dtype "$DTYPE"
    --prompt-tokens "$PROMPT" --new-tokens "$NEW" --warmup "$WARMUP" --runs "$RUNS" --compare
    --output "$OUT/bench_llama.json" --plot "$OUT/bench_llama.png")
echo "${BENCH_1B[*]}"
"${BENCH_1B[@]}"
summarize "$OUT/bench_llama.json"

# --- 3. the same comparison on the default tiny GPT-2 (host-bound: the worst case) ---------------
echo
echo "=== 3. otel-generate bench --compare --device $DEVICE, default tiny GPT-2 ==="
BENCH_TINY=("$PYTHON" -m otel_generate bench --device "$DEVICE" --new-tokens 128 --warmup "$WARMUP"
    --runs "$((RUNS * 2))" --compare --output "$OUT/bench_tiny.json")
echo "${BENCH_TINY[*]}"
"${BENCH_TINY[@]}"
summarize "$OUT/bench_tiny.json"

# --- 4. the synchronize's share of the tiny model's per-step cost ---------------------------------
echo
echo "=== 4. benchmarks/gpu_sync_split.py $DEVICE $((RUNS * 4)) ==="
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" benchmarks/gpu_sync_split.py "$DEVICE" "$((RUNS * 4))" \
    | tee "$OUT/sync_split.txt"

# --- 5. synchronize="events" vs "wait" vs uninstrumented, paired --------------------------------
echo
echo "=== 5. benchmarks/gpu_events.py $DEVICE $((RUNS * 3)), tiny GPT-2 ==="
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" benchmarks/gpu_events.py "$DEVICE" "$((RUNS * 3))" \
    | tee "$OUT/events_tiny.txt"
echo
echo "=== 5. benchmarks/gpu_events.py $DEVICE $RUNS, Llama-architecture config ($DTYPE, $NEW new tokens) ==="
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" benchmarks/gpu_events.py "$DEVICE" "$((RUNS < 4 ? 4 : RUNS))" \
    "$CONFIG" "$DTYPE" "$NEW" | tee "$OUT/events_llama.txt"

echo
echo "=== done: $(date -u +%Y-%m-%dT%H:%M:%SZ); files in $OUT; pytest -m gpu exit status $PYTEST_RC ==="
ls -l "$OUT"
exit "$PYTEST_RC"
