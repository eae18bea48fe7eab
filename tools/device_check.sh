#!/usr/bin/env bash
# The GPU checks in one call on a lent GPU machine (see docs/gpu.md, "On a
# GPU"): the `gpu` tests and aot_check side by side (both mostly compile),
# then `bench real_scale` (Llama-3.1-8B shapes, random bf16 weights, --quick,
# decode at batch 1 and 64 and the engine at its derived GPU defaults: under
# 6.5 minutes) alone on the card, then `bench scan_copy` (whether XLA copies
# a stacked layer's weight before its matmul, under the compiler options
# that might avoid it: under a minute); optional steps below.
# Every step has its own time limit and log under $OUT; the last lines are a
# summary. Usage: bash tools/device_check.sh [steps...] (default below).
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/device_check}; mkdir -p "$OUT"
PY=${PY:-python3}
# Default: what fits one call of under 9 minutes (tests and aot_check side by side, real_scale, scan_copy). The
# kernel and tiny-decode tables were measured twice on an H200 on 2026-11-28; name `kernels decode` for them,
# `engine_local` for the engine's programs compiled by the machine's own XLA (LAYERS=stacked|per-layer),
# `contiguous` for paged vs contiguous decode at Llama-3.1-8B's shapes (batch 1 and 64: under 5 minutes),
# `graphs` for that decode with the loop body captured as CUDA graphs (XLA command buffers: under 5 minutes),
# `merge` for it with gate and up merged into one GEMM by XLA's dot merger (under 5 minutes).
steps=${*:-"tests aot real_scale scan_copy"}
summary=()

run_step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s) - start ))s")
  echo "=== $name rc=$rc"; tail -n "${TAIL:-15}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"

pids=()
if [[ $steps == *aot* ]]; then
  (run_step aot 240 $PY -m kernels_pallas.aot_check) > "$OUT/aot.summary" 2>&1 &
  pids+=($!)
fi
if [[ $steps == *tests* ]]; then
  run_step tests 240 $PY -m pytest -q -m gpu -p no:cacheprovider -n 4 \
    tests/test_kernels_gather.py tests/test_kernels_paged_attention.py \
    tests/test_kernels_ragged_attention.py tests/test_nn_generate.py
fi
for p in "${pids[@]}"; do wait "$p"; done
[[ -f $OUT/aot.summary ]] && cat "$OUT/aot.summary"
if [[ $steps == *kernels* ]]; then run_step kernels 320 $PY -m jaxkv.bench kernels --json; fi
if [[ $steps == *decode* ]]; then run_step decode 150 $PY -m jaxkv.bench decode --json; fi
if [[ $steps == *engine_local* ]]; then  # the engine's programs compiled by this machine's XLA: temporaries
  for layers in ${LAYERS:-stacked per-layer}; do
    run_step engine_local_$layers 120 $PY -m jaxkv.bench engine_aot --local --models Llama-3.1-8B --buckets 16 \
      --layers $layers
  done
fi
if [[ $steps == *real_scale* ]]; then
  # The engine as a GPU user gets it: packed scheduler, rows / token budget / chunks / KV budget derived.
  run_step real_scale ${REAL_SCALE_S:-390} $PY -m jaxkv.bench real_scale --shapes llama-3.1-8b --quick \
    --no-contiguous --scheduler packed --max-num-seqs auto --requests 256 --deadline $(( ${REAL_SCALE_S:-390} - 60 )) --json
fi
if [[ $steps == *contiguous* ]]; then  # optional: paged vs contiguous decode at 8B (real_scale above skips it to fit)
  run_step contiguous 300 $PY -m jaxkv.bench real_scale --shapes llama-3.1-8b --quick --sections bandwidth,decode \
    --batches 1,64 --contiguous-batches 1,64 --deadline 240 --json
fi
if [[ $steps == *graphs* ]]; then  # optional: the decode chunk's loop body as CUDA graphs (XLA command buffers)
  # 16 kernels a layer in each decode step (docs/gpu.md); at batch 1 their launches are the likely part of the
  # step's gap to the roofline. The same decode section as real_scale's, with WHILE and CONDITIONAL added to what XLA captures.
  run_step graphs 300 env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
    $PY -m jaxkv.bench real_scale --shapes llama-3.1-8b --quick --sections bandwidth,decode --no-contiguous \
    --batches 1,64 --deadline 240 --json
fi
if [[ $steps == *merge* ]]; then  # optional: gate and up as one GEMM (XLA's dot merger, past its 32 MB default)
  # XLA already joins q, k and v (each weight under 32 MB); at Llama-3.1-8B's 117 MB gate and up weights it
  # does not. Raised, a deviceless compile shows 542 kernels a step instead of 574, no copy (docs/gpu.md).
  run_step merge 300 env XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_dot_merger_threshold_mb=256" \
    $PY -m jaxkv.bench real_scale --shapes llama-3.1-8b --quick --sections bandwidth,decode --no-contiguous \
    --batches 1,64 --deadline 240 --json
fi
if [[ $steps == *scan_copy* ]]; then  # last: a deadline hit above loses this, not real_scale
  run_step scan_copy 75 $PY -m jaxkv.bench scan_copy --json
fi
echo "=== summary"; printf '%s\n' "${summary[@]}"
if [[ -f $OUT/aot.summary ]]; then head -n 1 "$OUT/aot.summary"; fi
