#!/usr/bin/env bash
# Spark GPU resource discovery: prints {"name":"gpu","addresses":["0","1",...]} on stdout.
# Spark runs it on each executor (spark.executor.resource.gpu.discoveryScript) and hands each
# task one address, which the GPU searcher uses as its CUDA device ordinal.
#
# Addresses are CUDA ordinals as this process sees them: when the cluster manager has set
# CUDA_VISIBLE_DEVICES (e.g. "2,3" or GPU UUIDs), CUDA renumbers the visible devices 0..n-1,
# so those are printed (set but empty means no GPU). Otherwise every GPU nvidia-smi lists.
set -euo pipefail
if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
  count=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | sed '/^[[:space:]]*$/d' | wc -l)
  addresses=$(seq 0 $((count - 1)))
elif command -v nvidia-smi >/dev/null 2>&1; then
  addresses=$(nvidia-smi --query-gpu=index --format=csv,noheader)
else
  echo "gpu_discovery.sh: nvidia-smi not found and CUDA_VISIBLE_DEVICES unset" >&2
  exit 1
fi
list=$(sed '/^[[:space:]]*$/d; s/^[[:space:]]*//; s/[[:space:]]*$//; s/.*/"&"/' <<<"$addresses" | paste -sd, -)
echo "{\"name\":\"gpu\",\"addresses\":[${list}]}"
