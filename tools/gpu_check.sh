#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with one NVIDIA GPU, torch, Triton and transformers,
# and no network (docs/gpu.md shows its tables). From the repository root:
#
#   tools/gpu_check.sh OUT_DIR [STAGES]
#
# STAGES (default: all, in this order) is a comma-separated subset of
#   env       the device, driver and versions
#   tests     correctness on CUDA: every kernel against its torch reference at GPU shapes, the launch
#             defaults per head_dim and dtype, and the engine on CUDA against the engine on the CPU for
#             every policy (pytest -m cuda)
#   kernels   `kvpress bench kernels`, bf16: decode against the copy bandwidth, decode speedup over
#             dense SDPA, vertical-slash prefill, and each kernel against its floor at 8K and 32K
#             tokens per head; Llama-3-8B's attention (32/8 heads, d=128) and a d=256 shape (16/8)
#   decode    `kvpress bench decode-step` on a Llama-3-8B-shaped model with random bf16 weights:
#             batch 8 x 8K prompts, a step against its floor, and a profile of where the rest goes
#   policies  `kvpress bench policies` on the same model: compression time as a share of the
#             prefill, every registered policy, at 8K and 32K, and a profile of each compression
#
# Each stage writes OUT_DIR/<stage>.log (the model's too) and runs under its own time limit (a stage that overruns is
# cut and the next one starts); OUT_DIR/summary.txt says how each ended. No weights can be
# downloaded there, so the model is written on the machine with random weights: its outputs are
# noise, its tensors and KV pages have their real sizes. KVPRESS_GPU_CHECK_POLICIES and
# KVPRESS_GPU_CHECK_POLICY_LENS narrow the policies stage. Python packages the machine lacks come as
# wheels in .whl/ (see docs/gpu.md).
set -u
out=${1:?usage: tools/gpu_check.sh OUT_DIR [STAGES]}
stages=${2:-env,tests,kernels,decode,policies}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1 KVPRESS_DISABLE_CPU_KERNELS=1 TOKENIZERS_PARALLELISM=false
python=${PYTHON:-python3}
model=${KVPRESS_GPU_CHECK_MODEL:-/tmp/kvpress-llama3-8b-random}
policies=${KVPRESS_GPU_CHECK_POLICIES:-}  # the policies stage's policies (default: every registered one)
policy_lens=${KVPRESS_GPU_CHECK_POLICY_LENS:-8192,32768}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvpress-site .whl/*.whl
    export PYTHONPATH=/tmp/kvpress-site${PYTHONPATH:+:$PYTHONPATH}
fi
# The kernels live in kernels/ and install as vllm_kvpress_ext.kernels: an editable install maps them.
"$python" -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/kvpress-install.log 2>&1 ||
    { echo "install failed:"; cat /tmp/kvpress-install.log; exit 1; }
kvpress=("$python" -m vllm_kvpress_ext.cli)

run_stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local start rc
    start=$(date +%s)
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    local line="$name: exit $rc after $(($(date +%s) - start)) s"
    [ "$rc" = 124 ] && line="$line (cut at its limit)"
    echo "$line" | tee -a "$summary"
}

want() { [[ ",$stages," == *",$1,"* ]]; }

write_model='import sys, time
from pathlib import Path
from vllm_kvpress_ext.bench.models import shaped_model_dir, write_untrained_gates
if (Path(sys.argv[1]) / "config.json").exists():
    sys.exit(print(f"{sys.argv[1]} is already there"))
start = time.perf_counter()
path = shaped_model_dir("llama3-8b", sys.argv[1], "bfloat16", "cuda")
write_untrained_gates(path)
print(f"wrote {path} in {time.perf_counter() - start:.0f} s")'

if want env; then
    run_stage env 60 bash -c "nvidia-smi; $python -c 'import torch, triton, transformers, sys; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \
\"transformers\", transformers.__version__); p = torch.cuda.get_device_properties(0); \
print(p.name, p.multi_processor_count, \"SMs\", round(p.total_memory / 2**30, 1), \"GiB\")'; nvcc --version | tail -2"
fi
if want tests; then
    run_stage tests 200 env OMP_NUM_THREADS=2 "$python" -m pytest -q -m cuda -n 8 -p no:cacheprovider \
        tests/test_kernels.py tests/test_models.py tests/test_cuda_engine.py
fi
if want kernels; then
    for shape in 32/8/128 16/8/256; do
        heads=${shape%/*} head_dim=${shape##*/}
        run_stage "kernels-d$head_dim" 75 "${kvpress[@]}" bench kernels --dtype bfloat16 --heads "$heads" \
            --head-dim "$head_dim" \
            --requests 32 --kept-tokens 8192 --retentions 0.25 --prefill-lens 8192,32768 --floor-lens 8192,32768
    done
fi
if want decode || want policies; then
    run_stage model 90 "$python" -c "$write_model" "$model"
fi
if want decode; then
    run_stage decode 110 "${kvpress[@]}" bench decode-step --model "$model" --policies full,snapkv,h2o,wgkv \
        --batch 8 --prompt-len 8192 --steps 12 --profile-steps 3 --device cuda --dtype bfloat16
fi
if want policies; then
    run_stage policies 150 "${kvpress[@]}" bench policies --model "$model" --prompt-lens "$policy_lens" \
        ${policies:+--policies "$policies"} --decode-steps 4 --profile --device cuda --dtype bfloat16
fi
echo "== summary"
cat "$summary"
