# One device call's worth of GPU measurements for the open speed issues (host overhead, offload overlap), in the
# order a short lease should spend its time: every feature once on the device (a minute; a crash there is the
# worst finding), stage 3's host-bound 136M step under the profiler (its lanes show where the training thread
# waits), the 136M rows with FSDP2 beside them, the 1.34B rows with offload, the offloaded step's timeline, the host
# step beside busy cores, the exactness checks of offload's CUDA schedule, then batch 32. Each part has its own time
# limit, so a slow part costs its own figures and not the rest; everything goes to $OUT (the device tool's folder:
# at most 8 files come back, so a part's profiler tables are appended to its log) or ./gpu-session. PARTS picks
# parts, so that a lease can spend two calls on one warm machine (each bench_gpu run costs ~20 s of start-up).
#
#   bash benchmarks/gpu_session.sh                                            # every part, in order (~16 minutes)
#   PARTS="cuda_features profile_136m 136m" bash benchmarks/gpu_session.sh    # call 1 (timeout_s=420)
#   PARTS="1p34b timeline host_step cuda_checks" bash benchmarks/gpu_session.sh   # call 2, warm machine (what is left)
#   DRY=1 bash benchmarks/gpu_session.sh                                      # print the commands only
# The device image has torch, Lightning and torchmetrics; this package runs from the working tree.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-gpu-session}"
PY="${PY:-$(command -v python3 || command -v python)}"
PARTS="${PARTS:-cuda_features profile_136m 136m 1p34b timeline host_step cuda_checks batch32}"
mkdir -p "$OUT"
PROFILES="${TMPDIR:-/tmp}/gpu-session-profiles-$$"  # bench_gpu makes it
LARGE='{"vocab_size": 32768, "block_size": 1024, "n_layer": 24, "n_head": 16, "n_embd": 2048}'

part() {  # part NAME SECONDS COMMAND...: run one part under its limit, its output kept in $OUT/NAME.txt
    local name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name (limit ${limit}s): $(printf '%q ' "$@")"
    if [ -n "${DRY:-}" ]; then return 0; fi
    local start=$SECONDS
    timeout --signal=TERM --kill-after=15 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - start))s"
    tail -n 25 "$OUT/$name.txt"
    if [ -d "$PROFILES" ]; then  # --part profile's tables, one file per system: into the part's log
        for table in "$PROFILES"/*.txt; do [ -f "$table" ] && { echo "== $table"; cat "$table"; } >>"$OUT/$name.txt"; done
        rm -rf "$PROFILES"
    fi
}

if [ -z "${DRY:-}" ]; then
    nvidia-smi -L
    "$PY" -c "import torch, lightning, lightning_zero; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'lightning', lightning.__version__)" \
        || { echo "lightning_zero does not import here: nothing else is worth running"; exit 1; }
fi

# Every feature once on the device, against ddp, the plain run of its stage or the uninterrupted run.
part cuda_features 90 "$PY" benchmarks/cuda_features.py
# Issue 39: stage 3 on the 136M GPT took 2.9x DDP's step on the H200 (1.09x on the H100 earlier): where its
# training thread waits, beside FSDP2's, from the profiler's lanes (timeline.py) and operator tables.
part profile_136m 80 "$PY" benchmarks/bench_gpu.py --part profile --profile-dir "$PROFILES" --systems zero3,fsdp2 \
    --steps 3 --warmup 5
# Issue 39: the 136M GPT, host-bound on a fast GPU; stages 1-2 <= 1.05x DDP, stage 3 <= 1.30x and <= FSDP2. Two
# interleaved rounds (one round's ratio moved by 30-90% between calls on the H100); the host profile of round 0.
part 136m 240 "$PY" benchmarks/bench_gpu.py --part throughput --systems ddp,fsdp2,zero1,zero2,zero3 \
    --rounds 2 --steps 15 --warmup 5 --host-profile-steps 3
# Issues 39 and 40: the 1.34B GPT at batch 8 x 1024; stage 3 <= 1.05x DDP, exact overlap <= 2.2x, delayed <= 1.5x.
part 1p34b 200 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --rounds 1 --steps 4 \
    --warmup 2 --systems ddp,zero3,zero2+offload,zero3+offload,zero2+offload_delay
# Issue 40: what overlaps in the offloaded step (copy streams, the host-step thread, compute), exact and delayed.
part timeline 110 "$PY" benchmarks/bench_gpu.py --part profile --profile-dir "$PROFILES" --model "$LARGE" \
    --steps 2 --warmup 2 --systems zero2+offload,zero2+offload_delay
# Issue 40: the host AdamW step beside busy cores (the training and autograd threads), every thread against two fewer
# ([Note: host-step threads]).
part host_step 60 "$PY" benchmarks/bench_host_step.py --impls torch-fused --sizes 1e8 --threads 14,16 --busy 2 \
    --steps 3 --warmup 1
# Offload's schedules on a copy stream: every overlap_comm pair bit for bit, parts started during backward; fits after
# validate and predict (evaluated under inference mode on NCCL unless the strategy says otherwise); EMA resumed.
part cuda_checks 120 "$PY" benchmarks/cuda_checks.py
# Issue 40: exact overlap <= 1.3x DDP at batch 32 x 1024 (met on the H200 on 2026-12-04: 1.13x).
part batch32 90 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --batch-size 32 --rounds 1 \
    --steps 3 --warmup 1 --systems ddp,zero2+offload
