#!/usr/bin/env bash
# One device run: install in place, GPU tests, kernel/model microbenchmarks, end-to-end benchmarks.
# Everything lands under $OUT (logs + JSON). Stages: tests, kernels, gemm, model, host, bench, sampling, peers
# (default: all);
# tp (two GPUs: the TP=2 GPU test, then bench at TP=1 and TP=2) is only run when named.
set -uo pipefail
OUT=${OUT:-/tmp/nanovllm-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NANOVLLM_GPU_REPORT="$OUT/gpu_tests.jsonl"
STAGES=${*:-tests kernels gemm model host bench sampling peers}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
status=0
for stage in $STAGES; do
  echo "== $stage"
  case $stage in
    tests)   python3 -m pytest -q -m gpu -p no:cacheprovider tests/ \
               2>&1 | tee "$OUT/gpu_tests.log" | tail -15; rc=${PIPESTATUS[0]} ;;
    kernels) python3 scripts/bench_kernels.py > "$OUT/bench_kernels.json" 2>"$OUT/bench_kernels.err"; rc=$? ;;
    gemm)    python3 scripts/bench_gemm.py > "$OUT/bench_gemm.jsonl" 2>"$OUT/bench_gemm.err"; rc=$? ;;
    model)   python3 scripts/bench_model.py --profile --decode-batches 1 16 64 256 \
               > "$OUT/bench_model.json" 2>"$OUT/bench_model.err"; rc=$? ;;
    host)    { python3 scripts/bench_host.py --model qwen3-0.6b --json &&
               python3 scripts/bench_host.py --model qwen3-0.6b --temperature 0.8 --json; } \
               > "$OUT/bench_host.jsonl" 2>"$OUT/bench_host.err"; rc=$? ;;
    bench)   nanovllm bench --model qwen3-0.6b --load-format dummy --compare --json \
               > "$OUT/bench_compare.json" 2>"$OUT/bench_compare.err"; rc=$? ;;
    sampling) # the sampler alone, then one engine: greedy vs sampled (sync and async), and greedy + logprobs=5
             python3 scripts/bench_sampler.py "$OUT/bench_sampler.jsonl" 2>"$OUT/bench_sampler.err"; rc=$?
             for variant in greedy:"" sampled:"--temperature 0.8 --top-p 0.95 --top-k 50" logprobs5:"--logprobs 5"; do
               # shellcheck disable=SC2086
               nanovllm bench --model qwen3-0.6b --load-format dummy --compare --json ${variant#*:} \
                 > "$OUT/bench_sampling_${variant%%:*}.json" 2>"$OUT/bench_sampling_${variant%%:*}.err" || rc=1
             done ;;
    tp)      python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=240 tests/test_gpu_engine.py -k tp2 \
               2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -15; rc=${PIPESTATUS[0]}
             for size in 1 2; do
               nanovllm bench --model qwen3-0.6b --load-format dummy --compare --json --tensor-parallel-size $size \
                 > "$OUT/bench_tp$size.json" 2>"$OUT/bench_tp$size.err" || rc=1
             done ;;
    peers)   python3 scripts/bench_peers.py --model qwen3-0.6b --output-len 512 \
               > "$OUT/bench_peers.json" 2>"$OUT/bench_peers.err"; rc=$? ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== $stage exit $rc"
  [ "$rc" = 0 ] || status=1
done
exit $status
