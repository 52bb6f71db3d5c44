#!/usr/bin/env bash
# Tensor-parallel scaling on the offline workload (256 requests, inputs and outputs 100-1024):
# NovaInfer at tp 1, then tp 2 and 4 with both executors. One results file per configuration, with
# the median of REPEATS timed runs (default 3).
#   [REPEATS=3] bash benchmarks/tp_throughput.sh [ARCH] [TP_SIZES...]     default: qwen2-7b 1 2 4
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
arch=${1:-qwen2-7b}
shift || true
sizes=("${@:-1 2 4}")
for tp in ${sizes[@]}; do
  backends="uni mp"
  if [ "$tp" = 1 ]; then backends="uni"; fi
  for backend in $backends; do
    python3 benchmarks/throughput.py --arch "$arch" --peer none --repeats "${REPEATS:-3}" \
      --min-input 100 --max-input 1024 --min-output 100 --max-output 1024 \
      --tensor-parallel-size "$tp" --distributed-executor-backend "$backend" \
      --output "throughput_cuda_${arch}_tp${tp}_${backend}" ${RESULTS_DIR:+--results-dir "$RESULTS_DIR"}
  done
done
