#!/usr/bin/env bash
# One device call's worth of GPU measurements for the open speed issues (host overhead, offload overlap), in the
# order a short lease should spend its time: the exactness checks first (a failure there makes every timing moot),
# then the 136M host-bound rows with FSDP2 beside them, then the 1.34B offload rows. Each part has its own time
# limit, so a slow part costs its own figures and not the rest; everything goes to $OUT (the device tool's folder)
# or ./gpu-session. The limits add up to one device call's, with room for the machine's start.
#
#   bash benchmarks/gpu_session.sh            # run it (on the device: `run` with timeout_s=560 leaves a rerun)
#   DRY=1 bash benchmarks/gpu_session.sh      # print the commands only
# The device image has torch, Lightning and torchmetrics; this package runs from the working tree.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-gpu-session}"
mkdir -p "$OUT"
LARGE='{"vocab_size": 32768, "block_size": 1024, "n_layer": 24, "n_head": 16, "n_embd": 2048}'

part() {  # part NAME SECONDS COMMAND...: run one part under its limit, its output kept in $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $(printf '%q ' "$@")"
    if [ -n "${DRY:-}" ]; then return 0; fi
    local start=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - start))s"
    tail -n 25 "$OUT/$name.txt"
}

[ -n "${DRY:-}" ] || { nvidia-smi -L; python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"; } \
    >"$OUT/device.txt" 2>&1
[ -n "${DRY:-}" ] || cat "$OUT/device.txt"

# Offload's schedules on a copy stream: every overlap_comm pair bit for bit, parts started during backward; fits after
# validate and predict (evaluated under inference mode on NCCL unless the strategy says otherwise); EMA resumed.
part cuda_checks 140 python benchmarks/cuda_checks.py
# Issue 39: the 136M GPT, host-bound on a fast GPU; stages 1-2 <= 1.05x DDP, stage 3 <= 1.30x and <= FSDP2.
part throughput_136m 200 python benchmarks/bench_gpu.py --part throughput --systems ddp,fsdp2,zero1,zero2,zero3 \
    --rounds 2 --steps 10 --warmup 3
# Issue 40: the 1.34B GPT at batch 8 x 1024; exact overlap <= 2.2x DDP, the delayed update <= 1.5x.
part offload_1p34b 180 python benchmarks/bench_gpu.py --part throughput --model "$LARGE" --rounds 1 --steps 5 \
    --warmup 2 --systems ddp,zero2+offload,zero3+offload,zero2+offload_delay
