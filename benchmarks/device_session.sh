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
#      against eager) on the 1B shape, its kernels phase (torch.profiler: each prefill's and decode batch's device
#      time by kernel class, and the device's idle share of a step), and
#      kvtransfer_bandwidth.py --same-node cuda (an 8B-shaped 1,000-token prompt over CUDA IPC; goal >= 100 GB/s),
#      benchmarks/decode_host_overhead.py (the engine's host time per graph decode step, 1B shape, and the step's
#      wall with async scheduling against without; tests/engine/test_async_cuda.py checks its tokens first).
#   verdict (issue 43 item 6): benchmarks/disagg_vs_colocated.py --device cuda on the 1B checkpoint: one colocated
#      worker against 1P+1D on the same GPU (KV over CUDA IPC), chunked prefill at 512 tokens a step, the
#      conversation trace at full length (VERDICT_FLAGS=--async-scheduling: both sides' decoding engines run ahead).
#   profile (in the default PHASES, engine profile verdict gpu): `pdserve profile --device cuda --quick` on the 1B checkpoint (engine steps
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
#   samenode: the engine phase's same-node KV hand-off alone (kvtransfer_bandwidth.py --same-node cuda: all layers,
#      layer by layer, into scattered decode blocks). Next lease, suggested: PHASES="tests samenode engine8b verdict
#      profile" VERDICT_FLAGS="--async-scheduling --cores-per-worker 4".
#   engine8b: cuda_engine.py --shape 8b (decode, graphs, prefill, kernels). tests: the engine phase's CUDA tests alone. verdict-ep: the verdict's colocated side again with
#      its engine core in a process of its own (--engine-process). probe: benchmarks/invariance_probe.py (which kernel
#      or step breaks batch invariance). graphmem: the 1B engine's graph memory against its estimate.
# One deadline for the call (SESSION_S, default 570 s): each phase runs under its own cap or what the deadline leaves
# after the minimum the later phases are promised (*_PROMISED), so an early finish gives its time to the next one.
# The 1 Dec H200 lease ran, in three calls: the default phases (296 s); the verdict with
# VERDICT_FLAGS=--async-scheduling, 80 requests (149 s); PHASES="tests verdict verdict-ep probe graphmem" with
# VERDICT_FLAGS="--async-scheduling --cores-per-worker 4", rates 4,8,16, SESSION_S=320 (289 s).
# pdserve's CPU kernels are built in the background during phase 1 (one build, cached for every worker).
# At most 8 files come back from $OUT: the script writes only these.
set -u
OUT=${1:?usage: device_session.sh OUT_DIR}
# one deadline for the whole call (the tool's limit is 600 s a call): a phase gets its own cap or what is left of
# SESSION_S (less what the phases after it are promised), so a phase that ends early leaves its time to the next
SESSION_S=${SESSION_S:-570}
GPU_S=${GPU_S:-120} CPU14_S=${CPU14_S:-230} OVH_S=${OVH_S:-40} ENGINE_TEST_S=${ENGINE_TEST_S:-150} ENGINE_S=${ENGINE_S:-130}
VERDICT_S=${VERDICT_S:-200} VERDICT_N=${VERDICT_N:-60} VERDICT_RATES=${VERDICT_RATES:-4,8,16,32}
# which phases run (a lease split over calls runs some in each), and the GPU phase's and cpu14's load
PHASES=${PHASES:-"engine profile verdict gpu"}
GPU_C=${GPU_C:-1,32} GPU_REPEAT=${GPU_REPEAT:-1} GPU_FLAGS=${GPU_FLAGS:-}
CPU14_N=${CPU14_N:-70} CPU14_RATES=${CPU14_RATES:-1.5,3,4.5}
has() { [[ " $PHASES " == *" $1 "* ]]; }
# cap WANT [PROMISED]: WANT seconds, or what is left before the deadline less PROMISED (later phases' minimum)
cap() { local want=$1 left=$(( SESSION_S - SECONDS - ${2:-0} - 3 )); (( left < want )) && want=$left; (( want < 1 )) && want=1; echo $want; }
# enough MIN [PROMISED]: is there at least MIN seconds for this phase? (else it is skipped, and logged so)
enough() { (( $(cap 100000 "${2:-0}") >= $1 )) || { log "skipped: $(( SESSION_S - SECONDS )) s left"; false; }; }
export PYTHONUNBUFFERED=1
# every line of this script's own output also lands in session.log (at most 8 files come back from $OUT:
# session.log, engine_tests.log and the phases' JSON)
exec > >(tee -a "$OUT/session.log") 2>&1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # (bin: py-spy, for --py-spy)
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
TRACE=${TRACE:-.devdata/azure_llm_2023_conv.csv}
log() { echo "[$(date -u +%T) +${SECONDS}s] $*"; }
# the 1B-shaped bf16 checkpoint (benchmarks/cuda_engine.py's random weights), made once (the engine phase's
# cuda_engine.py writes the same one there)
ck1b() {
  [ -f /tmp/ck1b/model.safetensors ] || python3 -c "
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
  (MAX_JOBS=8 nice -n 5 python3 -m engine.kernels > /tmp/kernels.log 2>&1; echo "exit $?" >> /tmp/kernels.log) &
  KBUILD=$!
fi

if has engine || has tests; then
log "phase engine$(has engine || echo ': tests only')"
# the CUDA cases only: the CPU ones ran in CI (and would build the CPU kernels here first); the compiled Triton kernels
# in a pytest process of their own (the interpreter tests import triton in interpreter mode for their process), the
# rest in one process (one CUDA start); every test under a 90-s limit of its own, full output in engine_tests.log
PT="python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --timeout 90"
timeout -s INT "$(cap "$ENGINE_TEST_S" "${TESTS_PROMISED_1:-395}")" $PT tests/engine/test_triton_kernels_cuda.py \
  >> "$OUT/engine_tests.log" 2>&1; tail -3 "$OUT/engine_tests.log"
timeout -s INT "$(cap "$ENGINE_TEST_S" "${TESTS_PROMISED_2:-335}")" $PT -k "cuda or gpu" tests/engine/test_decode_graphs.py tests/engine/test_piecewise_cuda.py \
  tests/engine/test_async_cuda.py tests/engine/test_fp8_cuda.py tests/engine/test_sampler_cuda.py \
  tests/engine/test_batch_invariant_cuda.py tests/kvtransfer/test_cuda_ipc.py tests/cluster/test_dtype_cuda.py \
  tests/engine/test_architectures_cuda.py \
  >> "$OUT/engine_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED" "$OUT/engine_tests.log" | tail -20
fi

if has engine; then
log "cuda_engine.py"
timeout -s INT "$(cap "$ENGINE_S" 245)" python3 benchmarks/cuda_engine.py --phases "${ENGINE_PHASES:-parity,decode,graphs,prefill,kernels}" \
  --ckpt /tmp/ck1b --out /tmp/cuda_engine 2>&1 | grep -v "^\s*$"
cp /tmp/cuda_engine/cuda_engine.json "$OUT/cuda_engine.json" 2>/dev/null
# the host's share of a graph decode step at 1 / 64 / 256 sequences, and what async scheduling gains there
log "decode_host_overhead.py"
ck1b && timeout -s INT "$(cap 60 205)" python3 benchmarks/decode_host_overhead.py --device cuda --model /tmp/ck1b \
  --dtype bfloat16 --async-scheduling both --json "$OUT/host_overhead.json" 2>&1 | tail -12
log "kvtransfer_bandwidth.py --same-node cuda"
timeout -s INT "$(cap 40 185)" python3 benchmarks/kvtransfer_bandwidth.py --same-node cuda --reps 5 2>&1 | tail -8
cleanup
fi

if has samenode && enough 20; then
log "phase samenode: kvtransfer_bandwidth.py --same-node cuda (one copy a stretch for all layers since 1 Dec)"
timeout -s INT "$(cap 45 "${SAMENODE_PROMISED:-0}")" python3 benchmarks/kvtransfer_bandwidth.py --same-node cuda --reps 5 \
  2>&1 | tail -8
cleanup
fi

if has engine8b && enough 60; then
log "phase engine8b: cuda_engine.py on the Llama-3.1-8B shape (issue 43: <= 4.5 ms a decode step at batch 1-8)"
timeout -s INT "$(cap "${ENGINE8B_S:-180}" "${ENGINE8B_PROMISED:-0}")" python3 benchmarks/cuda_engine.py --shape 8b \
  --phases "${ENGINE8B_PHASES:-decode,graphs,prefill,kernels}" --out /tmp/cuda_engine_8b 2>&1 | grep -v "^\s*$"
cp /tmp/cuda_engine_8b/cuda_engine.json "$OUT/cuda_engine_8b.json" 2>/dev/null
fi

if has profile && enough 40 135; then
log "phase profile"
ck1b
timeout -s INT "$(cap "${PROFILE_S:-120}" 135)" python3 -m cluster.cli profile --device cuda --dtype bfloat16 --model /tmp/ck1b \
  --quick --skip-router --out "$OUT/profile_cuda.json" 2>&1 | tail -15
# how far those steps are from the device's roofline (datasheet peaks; a second of CPU)
HW=h200; nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100 && HW=h100-sxm
python3 benchmarks/roofline_check.py --profile "$OUT/profile_cuda.json" --hardware "$HW" --model cuda-bench-1b 2>&1
cleanup
fi

if has verdict && enough 60 "${VERDICT_PROMISED:-45}"; then
log "phase verdict"
ck1b
# partial.json comes back even if the call's own limit ends everything
( while sleep 10; do cp /tmp/verdict/partial.json "$OUT/verdict_partial.json" 2>/dev/null; done ) &
VCOPIER=$!
timeout -s INT "$(cap "$VERDICT_S" "${VERDICT_PROMISED:-45}")" python3 benchmarks/disagg_vs_colocated.py --device cuda --model /tmp/ck1b --trace "$TRACE" \
  --num-requests "$VERDICT_N" --length-scale 1 --rates "$VERDICT_RATES" --colocated-workers 1 --prefill-workers 1 \
  --decode-workers 1 --kv-cache-gib 8 --max-num-batched-tokens 512 ${VERDICT_FLAGS:-} --out /tmp/verdict 2>&1 \
  | grep -v "^\s*$"
kill "$VCOPIER" 2>/dev/null
cp /tmp/verdict/result.json "$OUT/verdict_result.json" 2>/dev/null && rm -f "$OUT/verdict_partial.json" \
  || cp /tmp/verdict/partial.json "$OUT/verdict_partial.json" 2>/dev/null
cleanup
fi

if has verdict-ep && enough 40; then
log "phase verdict-ep: colocated, its engine core in a process of its own"
ck1b
timeout -s INT "$(cap "${VERDICT_EP_S:-90}" "${VERDICT_EP_PROMISED:-0}")" python3 benchmarks/disagg_vs_colocated.py --device cuda \
  --model /tmp/ck1b --trace "$TRACE" --num-requests "$VERDICT_N" --length-scale 1 --rates "$VERDICT_RATES" \
  --modes colocated --colocated-workers 1 --kv-cache-gib 8 --max-num-batched-tokens 512 --engine-process \
  ${VERDICT_FLAGS:-} --out /tmp/verdict_ep 2>&1 | grep -v "^\s*$"
cp /tmp/verdict_ep/result.json "$OUT/verdict_ep_result.json" 2>/dev/null
cleanup
fi

if has probe && enough 20; then
log "phase probe: where batch invariance breaks (benchmarks/invariance_probe.py)"
timeout -s INT "$(cap "${PROBE_S:-60}" "${PROBE_PROMISED:-0}")" python3 benchmarks/invariance_probe.py 2>&1
fi

if has graphmem && enough 15; then
log "phase graphmem: the 1B engine's graph memory against its estimate"
ck1b
timeout -s INT "$(cap 40)" python3 -c "
from engine import LLM
e = LLM('/tmp/ck1b', device='cuda', dtype='bfloat16', kv_cache_memory_bytes=8 << 30).llm_engine
r = e.runner
print('1B bf16 graphs: estimate', e.graph_memory_estimate >> 20, 'MiB; decode graphs', r.graphs.memory_bytes >> 20,
      'MiB; piecewise', (r.piecewise.memory_bytes >> 20) if r.piecewise is not None else None, 'MiB')" 2>&1 | tail -3
fi

if has gpu && enough 45; then
log "phase gpu"
ck1b && timeout -s INT "$(cap "$GPU_S")" python3 benchmarks/serving_overhead.py --models /tmp/ck1b --modes colocated --apis grpc \
       --paths streams --repeat "$GPU_REPEAT" --concurrency "$GPU_C" --device cuda --dtype bfloat16 --kv-cache-gib 8 \
       $GPU_FLAGS --json "$OUT/serving_overhead_gpu.json" 2>&1 | grep -v "^\s*$"
cleanup
fi

if has invariance && enough 30; then
log "phase invariance"
ck1b
timeout -s INT "$(cap "${INV_S:-120}")" python3 benchmarks/batch_invariance.py --model /tmp/ck1b --device cuda \
  --dtypes bfloat16,float32 --num-prompts 128 --max-tokens 128 --kv-cache-gib 8 --batch-invariant both 2>&1
fi

if has cpu14 || has cpu-overhead; then
log "waiting for the CPU kernel build"
wait "$KBUILD"; tail -2 /tmp/kernels.log
fi

if has cpu14 && enough 60; then
log "phase cpu14"
( while sleep 10; do cp /tmp/cpu14/partial.json "$OUT/cpu14_partial.json" 2>/dev/null; done ) &
COPIER=$!
timeout -s INT "$(cap "$CPU14_S")" python3 benchmarks/disagg_vs_colocated.py --model bench --trace "$TRACE" --num-requests "$CPU14_N" \
  --length-scale 0.5 --rates "$CPU14_RATES" --colocated-workers 14 --prefill-workers 7 --decode-workers 7 \
  --local-prefill-max-tokens 192 --reserve-cores 2 --out /tmp/cpu14 2>&1 | grep -v "^\s*$"
kill "$COPIER" 2>/dev/null
cp /tmp/cpu14/result.json "$OUT/cpu14_result.json" 2>/dev/null || cp /tmp/cpu14/partial.json "$OUT/cpu14_partial.json" 2>/dev/null
cleanup
fi

if has cpu-overhead && enough 30; then
log "phase cpu-overhead"
timeout -s INT "$(cap "$OVH_S")" python3 benchmarks/serving_overhead.py --models tiny --modes colocated,disaggregated \
  --apis grpc --paths streams --repeat 1 --concurrency 1,32,128 --json "$OUT/serving_overhead_cpu16.json" 2>&1 \
  | grep -v "^\s*$" | tail -12
cleanup
fi
log "done"
