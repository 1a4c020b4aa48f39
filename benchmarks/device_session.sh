#!/usr/bin/env bash
# One device lease's serving checks, in one call (a GPU host with 16 cores; see docs/benchmarks.md).
#
# Lifecycle: run once on the lent machine from the repository root, with the wheels the image lacks in .whl/
# and the conversation trace in .devdata/ (`bash scripts/device_wheels` puts both there, ignored; carry both):
#     bash benchmarks/device_session.sh "$OUT"
# Phases, each under its own deadline (SIGINT, so deployments close) and each logged as it goes:
#   0. engine (issue 43): the decode-graph and Triton-kernel tests on the GPU (tests/engine/test_decode_graphs.py,
#      test_piecewise_cuda.py, tests/engine/test_triton_kernels_cuda.py: decode graph and piecewise replay equal
#      the uncaptured static path and eager greedy tokens; the kernels against SDPA on CUDA; FP8; the sampler's blocking wait; batch invariance;
#      tests/kvtransfer/test_cuda_ipc.py: two processes on the GPU move
#      KV over CUDA IPC), then benchmarks/cuda_engine.py's parity (fp32 strict with graphs
#      on), decode and graphs phases (graphs against --enforce-eager at each batch, and mixed steps piecewise
#      against eager) on the 1B shape, and
#      kvtransfer_bandwidth.py --same-node cuda (an 8B-shaped 1,000-token prompt over CUDA IPC; goal >= 100 GB/s),
#      benchmarks/decode_host_overhead.py (the engine's host time per graph decode step, 1B shape, and the step's
#      wall with async scheduling against without; tests/engine/test_async_cuda.py checks its tokens first).
#   verdict (issue 43 item 6): benchmarks/disagg_vs_colocated.py --device cuda on the 1B checkpoint: one colocated
#      worker against 1P+1D on the same GPU (KV over CUDA IPC), chunked prefill at 512 tokens a step, the
#      conversation trace at full length (VERDICT_FLAGS=--async-scheduling: both sides' decoding engines run ahead).
#   profile (not in the default PHASES): `pdserve profile --device cuda --quick` on the 1B checkpoint (engine steps
#      with the graphs, the gloo and cuda_ipc links), the input of docs/capacity.md's GPU tables, then
#      benchmarks/roofline_check.py: its steps against the device's roofline.
#   1. gpu: the cluster on CUDA for the first time: benchmarks/serving_overhead.py with --device cuda, a colocated
#      worker on the GPU against the offline engine on the same GPU, a Llama-3.2-1B-shaped bf16 checkpoint
#      (benchmarks/cuda_engine.py's random weights), gRPC, 1 / 8 / 32 / 128 streams (GPU_FLAGS=--async-scheduling:
#      both engines run ahead). Disaggregation is not run here: NCCL refuses two ranks on one device (the verdict
#      phase moves KV over CUDA IPC instead).
#   2. cpu14: benchmarks/disagg_vs_colocated.py on 14 worker cores (2 left to router and client): colocated 14
#      against 7P+7D with conditional disaggregation, the conversation trace at half length.
#   3. cpu-overhead: benchmarks/serving_overhead.py on `tiny` with the router on cores of its own.
#   invariance (not in the default PHASES): benchmarks/batch_invariance.py on the GPU, bf16 and fp32: does the
#      offline engine alone give other greedy tokens when requests arrive one per step (the cluster's 27 Nov
#      token differences on CUDA)? Without and with --batch-invariant.
# pdserve's CPU kernels are built in the background during phase 1 (one build, cached for every worker).
# At most 8 files come back from $OUT: the script writes only these.
set -u
OUT=${1:?usage: device_session.sh OUT_DIR}
GPU_S=${GPU_S:-120} CPU14_S=${CPU14_S:-230} OVH_S=${OVH_S:-40} ENGINE_TEST_S=${ENGINE_TEST_S:-120} ENGINE_S=${ENGINE_S:-200}
VERDICT_S=${VERDICT_S:-200} VERDICT_N=${VERDICT_N:-60} VERDICT_RATES=${VERDICT_RATES:-2,4,8,16}
# which phases run (a lease split over calls runs some in each), and the GPU phase's and cpu14's load
PHASES=${PHASES:-"engine verdict"}
GPU_C=${GPU_C:-1,8,32,128} GPU_REPEAT=${GPU_REPEAT:-2} GPU_FLAGS=${GPU_FLAGS:-}
CPU14_N=${CPU14_N:-70} CPU14_RATES=${CPU14_RATES:-1.5,3,4.5}
has() { [[ " $PHASES " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
TRACE=${TRACE:-.devdata/azure_llm_2023_conv.csv}
log() { echo "[$(date -u +%T)] $*"; }
# the 1B-shaped bf16 checkpoint (benchmarks/cuda_engine.py's random weights), made once
ck1b() {
  [ -d /tmp/ck1b ] || python3 -c "
import sys, torch; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from cuda_engine import make_checkpoint, SHAPES
make_checkpoint(Path('/tmp/ck1b'), SHAPES['1b'], device='cuda' if torch.cuda.is_available() else 'cpu')"
}
cleanup() { pkill -INT -f "multiprocessing.spawn" 2>/dev/null; sleep 2; pkill -KILL -f "multiprocessing.spawn" 2>/dev/null; true; }

log "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2); $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)"
python3 -c "import sys, torch, grpc, google.protobuf as pb; print('python', sys.version.split()[0], 'torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__, 'cuda', torch.cuda.is_available())" || exit 1
python3 -c "import router, decode_worker, prefill_worker, loadtest.client" || exit 1

KBUILD=
if has cpu14 || has cpu-overhead; then
  (MAX_JOBS=8 nice -n 5 python3 -m engine.kernels > "$OUT/kernels.log" 2>&1; echo "exit $?" >> "$OUT/kernels.log") &
  KBUILD=$!
fi

if has engine; then
log "phase engine"
# the CUDA cases only: the CPU ones ran in CI (and would build the CPU kernels here first); the compiled kernels in
# a pytest process of their own (the interpreter tests import triton in interpreter mode for their process)
for t in "tests/engine/test_decode_graphs.py -k cuda" tests/engine/test_piecewise_cuda.py tests/engine/test_async_cuda.py \
         tests/engine/test_triton_kernels_cuda.py \
         tests/engine/test_fp8_cuda.py tests/engine/test_sampler_cuda.py tests/engine/test_batch_invariant_cuda.py \
         "tests/kvtransfer/test_cuda_ipc.py -k gpu"; do
  timeout -s INT "$ENGINE_TEST_S" python3 -m pytest -q -p no:cacheprovider -rs $t 2>&1 | tail -20
done | tee "$OUT/engine_tests.log"
timeout -s INT 60 python3 benchmarks/kvtransfer_bandwidth.py --same-node cuda --reps 5 2>&1 | tail -8 \
  | tee "$OUT/same_node.log"
timeout -s INT "$ENGINE_S" python3 benchmarks/cuda_engine.py --phases "${ENGINE_PHASES:-parity,decode,graphs}" \
  --out /tmp/cuda_engine 2>&1 | tee "$OUT/engine.log" | grep -v "^\s*$"
cp /tmp/cuda_engine/cuda_engine.json "$OUT/cuda_engine.json" 2>/dev/null
# the host's share of a graph decode step at 1 / 64 / 256 sequences, and what async scheduling gains there
ck1b && timeout -s INT 150 python3 benchmarks/decode_host_overhead.py --device cuda --model /tmp/ck1b --dtype bfloat16 \
  --async-scheduling both 2>&1 | tail -12 | tee -a "$OUT/engine.log"
fi

if has verdict; then
log "phase verdict"
ck1b
# partial.json comes back even if the call's own limit ends everything (the engine phase may leave it little time)
( while sleep 10; do cp /tmp/verdict/partial.json "$OUT/verdict_partial.json" 2>/dev/null; done ) &
VCOPIER=$!
timeout -s INT "$VERDICT_S" python3 benchmarks/disagg_vs_colocated.py --device cuda --model /tmp/ck1b --trace "$TRACE" \
  --num-requests "$VERDICT_N" --length-scale 1 --rates "$VERDICT_RATES" --colocated-workers 1 --prefill-workers 1 \
  --decode-workers 1 --kv-cache-gib 8 --max-num-batched-tokens 512 ${VERDICT_FLAGS:-} --out /tmp/verdict 2>&1 \
  | tee "$OUT/verdict.log" \
  | grep -v "^\s*$"
kill "$VCOPIER" 2>/dev/null
cp /tmp/verdict/result.json "$OUT/verdict_result.json" 2>/dev/null || cp /tmp/verdict/partial.json "$OUT/verdict_partial.json" 2>/dev/null
cleanup
fi

if has profile; then
log "phase profile"
ck1b
timeout -s INT "${PROFILE_S:-240}" python3 -m cluster.cli profile --device cuda --dtype bfloat16 --model /tmp/ck1b \
  --quick --skip-router --out "$OUT/profile_cuda.json" 2>&1 | tail -15 | tee "$OUT/profile.log"
# how far those steps are from the device's roofline (datasheet peaks; a second of CPU)
HW=h200; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && HW=h100-sxm
python3 benchmarks/roofline_check.py --profile "$OUT/profile_cuda.json" --hardware "$HW" --model cuda-bench-1b 2>&1 \
  | tee -a "$OUT/profile.log"
fi

if has gpu; then
log "phase gpu"
ck1b && timeout -s INT "$GPU_S" python3 benchmarks/serving_overhead.py --models /tmp/ck1b --modes colocated --apis grpc \
       --paths streams --repeat "$GPU_REPEAT" --concurrency "$GPU_C" --device cuda --dtype bfloat16 --kv-cache-gib 8 \
       $GPU_FLAGS --json "$OUT/serving_overhead_gpu.json" 2>&1 | tee "$OUT/gpu.log" | grep -v "^\s*$"
cleanup
fi

if has invariance; then
log "phase invariance"
ck1b
timeout -s INT "${INV_S:-120}" python3 benchmarks/batch_invariance.py --model /tmp/ck1b --device cuda \
  --dtypes bfloat16,float32 --num-prompts 128 --max-tokens 128 --kv-cache-gib 8 --batch-invariant both 2>&1 \
  | tee "$OUT/invariance.log"
fi

if has cpu14 || has cpu-overhead; then
log "waiting for the CPU kernel build"
wait "$KBUILD"; tail -2 "$OUT/kernels.log"
fi

if has cpu14; then
log "phase cpu14"
# partial.json comes back even if the call's own limit ends everything: copied as it grows
( while sleep 10; do cp /tmp/cpu14/partial.json "$OUT/cpu14_partial.json" 2>/dev/null; done ) &
COPIER=$!
timeout -s INT "$CPU14_S" python3 benchmarks/disagg_vs_colocated.py --model bench --trace "$TRACE" --num-requests "$CPU14_N" \
  --length-scale 0.5 --rates "$CPU14_RATES" --colocated-workers 14 --prefill-workers 7 --decode-workers 7 \
  --local-prefill-max-tokens 192 --reserve-cores 2 --out /tmp/cpu14 2>&1 | tee "$OUT/cpu14.log" | grep -v "^\s*$"
kill "$COPIER" 2>/dev/null
cp /tmp/cpu14/result.json "$OUT/cpu14_result.json" 2>/dev/null || cp /tmp/cpu14/partial.json "$OUT/cpu14_partial.json" 2>/dev/null
cleanup
fi

if has cpu-overhead; then
log "phase cpu-overhead"
timeout -s INT "$OVH_S" python3 benchmarks/serving_overhead.py --models tiny --modes colocated,disaggregated \
  --apis grpc --paths streams --repeat 1 --concurrency 1,32,128 --json "$OUT/serving_overhead_cpu16.json" 2>&1 \
  | tee "$OUT/cpu_overhead.log" | grep -v "^\s*$" | tail -12
cleanup
fi
log "done"
