#!/usr/bin/env bash
# Entrypoint of the CPU image: builds the `kvpress serve` command line from KVPRESS_* variables, then
# execs it so the server is PID 1's direct replacement and gets SIGTERM from the container runtime.
#
#   KVPRESS_MODEL_DIR          model directory; empty serves the bundled model
#   KVPRESS_KV_POLICY          default policy: a name, a preset path, or empty for `full` (image: snapkv)
#   KVPRESS_PRESETS_DIR        where NAME.yaml presets live (image: /etc/kvpress/presets); a bare policy
#                              name with a preset there is passed as that file, so an edited preset applies
#   KVPRESS_HOST, KVPRESS_PORT address and port to bind (image: 0.0.0.0, 8000)
#   KVPRESS_KV_MEMORY          KV pool size, e.g. 512MiB (exclusive with KVPRESS_NUM_PAGES)
#   KVPRESS_NUM_PAGES          KV pool size in pages
#   KVPRESS_MAX_NUM_SEQS, KVPRESS_MAX_MODEL_LEN, KVPRESS_SERVED_MODEL_NAME, KVPRESS_LOG_LEVEL
#   KVPRESS_PRINT_COMMAND=1    print the command, one argument per line, and exit instead of running it
#
# Arguments are appended after the ones built here; a first argument that is not a flag is MODEL_DIR.
set -euo pipefail

fail() {
  echo "kvpress-entrypoint: $*" >&2
  exit 2
}

require_integer() {  # NAME VALUE MIN MAX
  [[ "$2" =~ ^[0-9]{1,10}$ ]] || fail "$1 must be an integer, got '$2'"
  ((10#$2 >= $3 && 10#$2 <= $4)) || fail "$1 must be between $3 and $4, got $2"
}

model_dir="${KVPRESS_MODEL_DIR:-}"
if [[ $# -gt 0 && "$1" != -* ]]; then
  model_dir="$1"
  shift
fi

host="${KVPRESS_HOST:-0.0.0.0}"
port="${KVPRESS_PORT:-8000}"
require_integer KVPRESS_PORT "$port" 1 65535

cmd=(kvpress serve)
if [[ -n "$model_dir" ]]; then
  [[ -f "$model_dir/config.json" ]] || fail "model directory '$model_dir' has no config.json"
  cmd+=("$model_dir")
fi

policy="${KVPRESS_KV_POLICY:-}"
presets_dir="${KVPRESS_PRESETS_DIR:-}"
if [[ -n "$policy" ]]; then
  if [[ -n "$presets_dir" && "$policy" != */* && -f "$presets_dir/$policy.yaml" ]]; then
    policy="$presets_dir/$policy.yaml"
  fi
  cmd+=(--kv-policy "$policy")
fi

cmd+=(--host "$host" --port "$port")

if [[ -n "${KVPRESS_KV_MEMORY:-}" && -n "${KVPRESS_NUM_PAGES:-}" ]]; then
  fail "set KVPRESS_KV_MEMORY or KVPRESS_NUM_PAGES, not both"
fi
[[ -z "${KVPRESS_KV_MEMORY:-}" ]] || cmd+=(--kv-memory "$KVPRESS_KV_MEMORY")
if [[ -n "${KVPRESS_NUM_PAGES:-}" ]]; then
  require_integer KVPRESS_NUM_PAGES "$KVPRESS_NUM_PAGES" 1 2147483647
  cmd+=(--num-pages "$KVPRESS_NUM_PAGES")
fi
if [[ -n "${KVPRESS_MAX_NUM_SEQS:-}" ]]; then
  require_integer KVPRESS_MAX_NUM_SEQS "$KVPRESS_MAX_NUM_SEQS" 1 1048576
  cmd+=(--max-num-seqs "$KVPRESS_MAX_NUM_SEQS")
fi
if [[ -n "${KVPRESS_MAX_MODEL_LEN:-}" ]]; then
  require_integer KVPRESS_MAX_MODEL_LEN "$KVPRESS_MAX_MODEL_LEN" 1 2147483647
  cmd+=(--max-model-len "$KVPRESS_MAX_MODEL_LEN")
fi
[[ -z "${KVPRESS_SERVED_MODEL_NAME:-}" ]] || cmd+=(--served-model-name "$KVPRESS_SERVED_MODEL_NAME")
[[ -z "${KVPRESS_LOG_LEVEL:-}" ]] || cmd+=(--log-level "$KVPRESS_LOG_LEVEL")

cmd+=("$@")

if [[ "${KVPRESS_PRINT_COMMAND:-0}" == "1" ]]; then
  printf '%s\n' "${cmd[@]}"
  exit 0
fi
exec "${cmd[@]}"
