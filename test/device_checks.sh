#!/bin/bash
# The checks for one call on a lent GPU machine (CONTRIBUTING.md, "With a GPU"), from the repository root:
#
#   bash test/device_checks.sh [WHEEL_DIR]
#
# WHEEL_DIR: wheels to install first (the GPU image has no expecttest, which test_cpu_kernel.py imports).
# Runs the CUDA checks and a CUDA step benchmark on one half of the CPUs while the other half builds the C
# kernel natively and without its vector paths (equal bits; AVX-512 VBMI on that machine's Xeon), then the
# per-parameter cost of many parameters' calls on CUDA (bench_call_overhead: batches of small parameters'
# calls since 6dc6f81), and a whole GPT-like model's step at 98 and 290 tensors (bench_model_step: host
# time per step against the tensor count, 8bit against torch fused and bitsandbytes where installed), and the
# same model's step on one CPU thread. About 7-8 minutes; logs and JSON under $OUT (or /tmp/device_checks).
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/qstate_device_inductor
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ $# -ge 1 ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/qstate_device_site "$1"/*.whl \
        && export PYTHONPATH=/tmp/qstate_device_site:$PYTHONPATH
fi
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) CPUs," \
     "$(grep -o 'avx512vbmi\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
half=$(( $(nproc) / 2 ))
( taskset -c "$half-$(( $(nproc) - 1 ))" timeout 240 python3 -m pytest test/kernels/test_cpu_kernel.py -q -p no:randomly \
      -k builds_without_vector_paths > "$out/vector_paths.log" 2>&1
  echo "vector-path builds rc=$?" >> "$out/vector_paths.log" ) &
echo "== cuda_checks"
taskset -c "0-$(( half - 1 ))" timeout 240 python3 test/cuda_checks.py
echo "cuda_checks rc=$?"
echo "== bench_step --device cuda"
taskset -c "0-$(( half - 1 ))" timeout 150 python3 benchmarks/bench_step.py --device cuda --sizes 16M,256M \
    --only 8bit,4bit,fp8 --repeats 9 --out "$out/cuda" | grep -A30 "^16M:"
wait
echo "== C kernel: native build against builds without AVX-512 / AVX2"
tail -3 "$out/vector_paths.log"
for shape in 1024x1024 256x640; do
    echo "== bench_call_overhead --device cuda --shape $shape"
    timeout 120 python3 benchmarks/bench_call_overhead.py --device cuda --params 64 --shape $shape --repeats 9 \
        --out "$out/calls_$shape" | tail -5
done
for layers in 8 24; do
    echo "== bench_model_step --device cuda --layers $layers"
    timeout 150 python3 benchmarks/bench_model_step.py --device cuda --layers $layers --repeats 9 \
        --out "$out/model_$layers" | tail -12
done
echo "== bench_model_step on the CPU, one thread (the 8bit step against torch fused on this Xeon)"
taskset -c 0 timeout 120 python3 benchmarks/bench_model_step.py --threads 1 --repeats 5 --no-third-party \
    --formats 8bit,fp8 --out "$out/model_cpu" | tail -8
