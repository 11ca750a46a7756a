#!/usr/bin/env bash
# On a lent GPU machine, after benchmarks/gpu_carry.py's calls installed TensorFlow into /tmp/site:
# name CUDA 13's libraries under the CUDA 12 names TensorFlow 2.21 loads, then run the GPU
# benchmarks (gpu_throughput.py, about 8 minutes; gpu_offload.py, a few), their JSON into $OUT.
# Not yet run on a lent machine.
set -uo pipefail
export PYTHONPATH="/tmp/site:$PWD" TF_CPP_MIN_LOG_LEVEL=2
out="${OUT:-/tmp/tflms-out}"
mkdir -p "$out" /tmp/cuda12
# CUDA 13 soname -> the major version TensorFlow 2.21 asks for.
declare -A major=([libcufft]=11 [libcusolver]=11 [libcurand]=10 [libcudnn]=9 [libnccl]=2)
for dir in $(python3 -c "import nvidia, os; print(*[os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in os.listdir(p)])"); do
  for lib in "$dir"/lib*.so.*; do
    [ -e "$lib" ] || continue
    stem=$(basename "$lib"); stem=${stem%%.so.*}
    ln -sf "$lib" "/tmp/cuda12/$stem.so.${major[$stem]:-12}"
  done
done
export LD_LIBRARY_PATH="/tmp/cuda12:${LD_LIBRARY_PATH:-}"
python3 -c "import tensorflow as tf; print(tf.__version__, tf.config.list_physical_devices('GPU'))" | tee "$out/gpu_session.txt"
timeout 500 python3 benchmarks/gpu_throughput.py --deadline 420 --json "$out/gpu_throughput.json" 2>&1 | tail -40 | tee -a "$out/gpu_session.txt"
timeout 300 python3 benchmarks/gpu_offload.py --json "$out/gpu_offload.json" 2>&1 | tail -20 | tee -a "$out/gpu_session.txt"
