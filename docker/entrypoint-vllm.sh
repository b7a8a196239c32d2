#!/usr/bin/env bash
# Entrypoint of the vLLM image: builds the `vllm serve` command line from KVPRESS_* variables, then
# execs it so vLLM's API server replaces this shell and gets SIGTERM from the container runtime.
#
#   KVPRESS_MODEL_DIR          model directory or id (required unless given as the first argument)
#   KVPRESS_KV_POLICY          default policy: a name, a preset path or JSON (image: snapkv); empty passes
#                              no --kv-policy, which leaves vLLM uncompressed and the plugin inactive
#   KVPRESS_PRESETS_DIR        where NAME.yaml presets live (image: /etc/kvpress/presets); a bare policy
#                              name with a preset there is passed as that file, so an edited preset applies
#   KVPRESS_HOST, KVPRESS_PORT address and port to bind (image: 0.0.0.0, 8000)
#   KVPRESS_MAX_NUM_SEQS, KVPRESS_MAX_MODEL_LEN, KVPRESS_SERVED_MODEL_NAME
#   KVPRESS_GPU_MEMORY_UTILIZATION  vLLM's --gpu-memory-utilization, e.g. 0.9
#   KVPRESS_TENSOR_PARALLEL_SIZE, KVPRESS_PIPELINE_PARALLEL_SIZE, KVPRESS_DATA_PARALLEL_SIZE
#                                   vLLM's --tensor/--pipeline/--data-parallel-size
#   KVPRESS_NNODES, KVPRESS_NODE_RANK, KVPRESS_MASTER_ADDR, KVPRESS_MASTER_PORT
#                              one server over several nodes (vLLM's multiprocessing executor): node 0
#                              serves HTTP, every other node runs its workers only (--headless)
#   KVPRESS_PRINT_COMMAND=1    print the command, one argument per line, and exit instead of running it
#
# Arguments are appended after the ones built here (any `vllm serve` flag); a first argument that is
# not a flag is the model.
set -euo pipefail

fail() {
  echo "kvpress-entrypoint: $*" >&2
  exit 2
}

require_integer() {  # NAME VALUE MIN MAX
  [[ "$2" =~ ^[0-9]{1,10}$ ]] || fail "$1 must be an integer, got '$2'"
  ((10#$2 >= $3 && 10#$2 <= $4)) || fail "$1 must be between $3 and $4, got $2"
}

model="${KVPRESS_MODEL_DIR:-}"
if [[ $# -gt 0 && "$1" != -* ]]; then
  model="$1"
  shift
fi
[[ -n "$model" ]] || fail "no model: set KVPRESS_MODEL_DIR or pass the model directory as the first argument"

host="${KVPRESS_HOST:-0.0.0.0}"
port="${KVPRESS_PORT:-8000}"
require_integer KVPRESS_PORT "$port" 1 65535

cmd=(vllm serve "$model")

policy="${KVPRESS_KV_POLICY:-}"
presets_dir="${KVPRESS_PRESETS_DIR:-}"
if [[ -n "$policy" ]]; then
  if [[ -n "$presets_dir" && "$policy" != */* && "$policy" != \{* && -f "$presets_dir/$policy.yaml" ]]; then
    policy="$presets_dir/$policy.yaml"
  fi
  cmd+=(--kv-policy "$policy")
fi

nnodes="${KVPRESS_NNODES:-1}"
require_integer KVPRESS_NNODES "$nnodes" 1 1024
node_rank="${KVPRESS_NODE_RANK:-0}"
require_integer KVPRESS_NODE_RANK "$node_rank" 0 $((nnodes - 1))
if ((nnodes > 1 && node_rank > 0)); then
  cmd+=(--headless)  # this node's workers only: node 0 serves the API
else
  cmd+=(--host "$host" --port "$port")
fi
if ((nnodes > 1)); then
  [[ -n "${KVPRESS_MASTER_ADDR:-}" ]] || fail "KVPRESS_NNODES=$nnodes needs KVPRESS_MASTER_ADDR (node 0's address)"
  cmd+=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "$KVPRESS_MASTER_ADDR")
  if [[ -n "${KVPRESS_MASTER_PORT:-}" ]]; then
    require_integer KVPRESS_MASTER_PORT "$KVPRESS_MASTER_PORT" 1 65535
    cmd+=(--master-port "$KVPRESS_MASTER_PORT")
  fi
fi
for name in TENSOR_PARALLEL_SIZE PIPELINE_PARALLEL_SIZE DATA_PARALLEL_SIZE; do
  variable="KVPRESS_$name"
  if [[ -n "${!variable:-}" ]]; then
    require_integer "$variable" "${!variable}" 1 1024
    flag="--${name,,}"
    cmd+=("${flag//_/-}" "${!variable}")
  fi
done

if [[ -n "${KVPRESS_MAX_NUM_SEQS:-}" ]]; then
  require_integer KVPRESS_MAX_NUM_SEQS "$KVPRESS_MAX_NUM_SEQS" 1 1048576
  cmd+=(--max-num-seqs "$KVPRESS_MAX_NUM_SEQS")
fi
if [[ -n "${KVPRESS_MAX_MODEL_LEN:-}" ]]; then
  require_integer KVPRESS_MAX_MODEL_LEN "$KVPRESS_MAX_MODEL_LEN" 1 2147483647
  cmd+=(--max-model-len "$KVPRESS_MAX_MODEL_LEN")
fi
[[ -z "${KVPRESS_SERVED_MODEL_NAME:-}" ]] || cmd+=(--served-model-name "$KVPRESS_SERVED_MODEL_NAME")
if [[ -n "${KVPRESS_GPU_MEMORY_UTILIZATION:-}" ]]; then
  [[ "$KVPRESS_GPU_MEMORY_UTILIZATION" =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] ||
    fail "KVPRESS_GPU_MEMORY_UTILIZATION must be a fraction in (0, 1], got '$KVPRESS_GPU_MEMORY_UTILIZATION'"
  cmd+=(--gpu-memory-utilization "$KVPRESS_GPU_MEMORY_UTILIZATION")
fi

cmd+=("$@")

if [[ "${KVPRESS_PRINT_COMMAND:-0}" == "1" ]]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
exec "${cmd[@]}"
