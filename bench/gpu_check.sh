#!/usr/bin/env bash
# The GPU check: one short script for a machine with CUDA GPUs. It runs
#   1. the demo (`trainctl demo`: the embedded stack, SQLite, one worker) on cuda, bf16 autocast;
#   2. the throughput bench at GPU size (bench/train_throughput.py --device cuda --size gpu:
#      tokens/s and MFU of trainctl's loop and of a bare PyTorch loop, against the GPU's peak);
#   2b. the cost of the private-RNG function mode (worker/model/rng.py) on the GPU model: the
#      bare step timed with and without it (train_throughput.py --rng-mode), the ratio printed;
#      then again with attention dropout 0.1, where the mode's own dropout path runs too;
#   3. when two GPUs are there, the demo with every phase on two ranks (NCCL): replicated (DDP),
#      then sharded (FSDP2, checkpoints written shard by shard);
# and prints one summary. Logs go to $OUT (the device tool's folder) or a temporary directory.
#
#   bash bench/gpu_check.sh            # PYTHON=... to pick an interpreter with CUDA torch
#
# It needs torch with CUDA and the worker's packages (transformers, tokenizers, safetensors,
# numpy, zstandard) plus the service's (fastapi, uvicorn, sqlalchemy, alembic, ...) importable
# by $PYTHON; the repository itself is put on PYTHONPATH. Nothing is downloaded at run time.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "${gpus:-0}" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is false)" >&2
    exit 2
fi
name=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
echo "gpu_check: $gpus x $name; logs in $out"

demo() {  # demo LOG [WORKFLOW]: the embedded demo on cuda, its own home
    local log=$1 home
    home=$(mktemp -d)
    shift
    local started=$SECONDS
    TRAINCTL_HOME=$home TRAINCTL_DEVICE=cuda "$@" "$PY" -m cli demo ${WORKFLOW:+--workflow "$WORKFLOW"} \
        >"$log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - started))"
}

read -r demo_rc demo_s < <(demo "$out/demo.log" env)
"$PY" bench/train_throughput.py --device cuda --size gpu --rounds 3 --steps 10 \
    >"$out/throughput.md" 2>"$out/throughput.err"
bench_rc=$?
rng_mode() {  # rng_mode LOG [ARGS...]: the bare step with and without the private-RNG mode
    local log=$1
    shift
    "$PY" bench/train_throughput.py --rng-mode --device cuda --size gpu --rounds 3 --steps 10 "$@" \
        >"$out/$log.md" 2>"$out/$log.err"
    local rc=$?
    local ratio
    ratio=$(sed -n 's/^rng mode ratio .*: //p' "$out/$log.md")
    echo "${ratio:-none} $rc"
}
read -r rng_ratio rng_rc < <(rng_mode rng_mode)
read -r rng_dropout_ratio rng_dropout_rc < <(rng_mode rng_mode_dropout --dropout 0.1)

two="skipped (one GPU)"
sharded="skipped (one GPU)"
two_ranks() {  # two_ranks SHARDING LOG: the demo with every phase on two ranks
    WORKFLOW="$out/demo.$1.json"
    "$PY" - "$WORKFLOW" "$1" <<'EOF'
import json, sys
from pathlib import Path
from runtime.path import resolve_paths
demo = Path("examples/workflows/demo.json")
doc = resolve_paths(json.loads(demo.read_text()), demo.parent)
doc["name"] = f"demo-two-ranks-{sys.argv[2]}"
doc["resources"] = {"devices": 2, "sharding": sys.argv[2]}
for phase in doc["phases"]:  # a step's microbatches over both ranks: a multiple of 2
    phase["grad_accum"] = 2 * phase.get("grad_accum", 1)
Path(sys.argv[1]).write_text(json.dumps(doc))
EOF
    export WORKFLOW
    local rc s
    read -r rc s < <(demo "$out/$2" env TRAINCTL_DEVICES=2)
    unset WORKFLOW
    echo "exit $rc in ${s}s ($( [ "$rc" = 0 ] && echo 'loss fell, every task beat its baseline' || echo "FAILED: see $2"))"
    return "$rc"
}
if [ "$gpus" -ge 2 ]; then
    two=$(two_ranks replicate demo.two-ranks.log)
    two_rc=$?
    sharded=$(two_ranks fsdp demo.two-ranks-fsdp.log)
    sharded_rc=$?
fi

echo
echo "## GPU check: $gpus x $name"
echo
echo "- demo on cuda (bf16): exit $demo_rc in ${demo_s}s" \
    "($( [ "$demo_rc" = 0 ] && echo 'loss fell, every task beat its baseline' || echo 'FAILED: see demo.log'))"
echo "- two-rank demo (NCCL, DDP): $two"
echo "- two-rank demo (NCCL, FSDP2, sharded checkpoints): $sharded"
echo "- private-RNG function mode, tokens/s with / without (below 1: it costs): $rng_ratio" \
    "(exit $rng_rc); with attention dropout 0.1: $rng_dropout_ratio (exit $rng_dropout_rc)"
echo "- throughput bench (exit $bench_rc):"
echo
sed 's/^/    /' "$out/throughput.md"
echo
echo "- private-RNG function mode (rng_mode.md, rng_mode_dropout.md):"
echo
sed 's/^/    /' "$out/rng_mode.md" "$out/rng_mode_dropout.md"
tail -n 15 "$out/demo.log" >"$out/demo.tail" 2>/dev/null
[ "$demo_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$rng_rc" = 0 ] && { [ "$gpus" -lt 2 ] || { [ "${two_rc:-0}" = 0 ] && [ "${sharded_rc:-0}" = 0 ]; }; }
