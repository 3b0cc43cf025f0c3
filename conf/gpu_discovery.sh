#!/usr/bin/env bash
# Spark GPU resource discovery: prints {"name":"gpu","addresses":["0","1",...]} on stdout.
# Spark runs it on each executor (spark.executor.resource.gpu.discoveryScript).
# Honours CUDA_VISIBLE_DEVICES when the cluster manager has already narrowed the devices.
set -euo pipefail
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  addresses=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | sed '/^$/d')
elif command -v nvidia-smi >/dev/null 2>&1; then
  addresses=$(nvidia-smi --query-gpu=index --format=csv,noheader)
else
  echo "gpu_discovery.sh: nvidia-smi not found and CUDA_VISIBLE_DEVICES unset" >&2
  exit 1
fi
list=$(sed 's/^[[:space:]]*//; s/[[:space:]]*$//; s/.*/"&"/' <<<"$addresses" | paste -sd, -)
echo "{\"name\":\"gpu\",\"addresses\":[${list}]}"
