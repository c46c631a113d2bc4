# One device call's worth of GPU measurements for the open speed issues, in the order a short lease should spend its
# time: every feature once on the device (a minute; a crash there is the worst finding: the partial-offload row
# failed on the H200 on 2026-12-04 and was fixed after the lease), the 1.34B rows with offload (issue 40), the
# offloaded step's timeline with the host's waits for the device by calling stack, the host step beside busy
# cores and on idle ones at the 1.34B GPT's size (the floor of any offloaded step on that host), the exactness checks
# of offload's CUDA schedule, then the 136M rows and stage 3's profile beside FSDP2's (issue 39's regression check)
# and batch 16 and 32. Each part has its own time limit, so a slow part costs its own
# figures and not the rest; everything goes to $OUT (the device tool's folder: at most 8 files come back, so a
# part's profiler tables are appended to its log) or ./gpu-session. PARTS picks parts, so that a lease can spend
# two calls on one warm machine (each bench_gpu run costs ~20 s of start-up; a warm machine goes back after 30 s
# idle, so the second call must follow at once).
#
#   bash benchmarks/gpu_session.sh                                            # every part, in order (~25 minutes)
#   PARTS="cuda_features 1p34b batch32_delay" bash benchmarks/gpu_session.sh  # call 1 (timeout_s=440)
#   PARTS="1p34b_clip timeline3 136m" bash benchmarks/gpu_session.sh          # call 2 (what is left)
#   DRY=1 bash benchmarks/gpu_session.sh                                      # print the commands only
# The device image has torch, Lightning and torchmetrics; this package runs from the working tree.
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-gpu-session}"
PY="${PY:-$(command -v python3 || command -v python)}"
PARTS="${PARTS:-cuda_features 1p34b timeline host_step host_floor 1p34b_clip timeline3 batch16 delay_threads cuda_checks 136m profile_136m batch32 batch32_delay}"
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
# Issues 39 and 40: the 1.34B GPT at batch 8 x 1024; stage 3 <= 1.05x DDP, exact overlap <= 2.2x, delayed <= 1.5x.
part 1p34b 200 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --rounds 1 --steps 4 \
    --warmup 2 --systems ddp,zero3,zero2+offload,zero3+offload,zero2+offload_delay
# Issue 40: what overlaps in the offloaded step (copy streams, the host-step thread, compute), exact and delayed, and
# which lines of the step make the host wait for the device (the delayed step's training thread waited 165 ms a step
# in event and stream synchronisations on 2026-12-04).
part timeline 130 "$PY" benchmarks/bench_gpu.py --part profile --profile-dir "$PROFILES" --model "$LARGE" \
    --steps 2 --warmup 2 --sync-steps 1 --systems zero2+offload,zero2+offload_delay
# Issue 40: the host AdamW step beside busy cores (the training and autograd threads), every thread against two fewer
# ([Note: host-step threads]; 1032 against 24.5 ms on the H200's host on 2026-12-04).
part host_step 60 "$PY" benchmarks/bench_host_step.py --impls torch-fused --sizes 1e8 --threads 14,16 --busy 2 \
    --steps 3 --warmup 1
# Issue 40: this host's floor for the 1.34B GPT's host step: torch's fused AdamW over its 1.34e9 fp32 elements on idle
# cores, every thread and two fewer (the delayed 1.34B step is that step plus what it cannot hide).
part host_floor 120 "$PY" benchmarks/bench_host_step.py --impls torch-fused --sizes 1.344e9 --threads 14,16 \
    --steps 3 --warmup 1
# Offload as LLM recipes run it, gradients clipped: the host step waits for backward's end (the clip's norm) there.
part 1p34b_clip 130 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --rounds 1 --steps 4 \
    --warmup 2 --systems ddp,zero2+offload --gradient-clip-val 1.0
# Issue 40: where stage 3's offloaded step spends its time (one throughput run took 948 ms on the H200 on 2026-12-04,
# against 523-535 ms in the others that day: not yet explained).
part timeline3 80 "$PY" benchmarks/bench_gpu.py --part profile --profile-dir "$PROFILES" --model "$LARGE" \
    --steps 2 --warmup 2 --systems zero3+offload
# Issue 40: batch 16 x 1024, where forward and backward take about as long as the host step: what the overlap hides
# once there is compute to hide it behind.
part batch16 170 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --batch-size 16 --rounds 1 \
    --steps 3 --warmup 2 --systems ddp,zero2+offload,zero2+offload_delay
# Issue 40: the delayed update's host step on every core (the package leaves two to the training threads).
part delay_threads 70 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --rounds 1 --steps 4 \
    --warmup 2 --systems zero2+offload_delay --cores-left-to-training 0
# Offload's schedules on a copy stream: every overlap_comm pair bit for bit, parts started during backward; fits after
# validate and predict (evaluated under inference mode on NCCL unless the strategy says otherwise); EMA resumed.
part cuda_checks 120 "$PY" benchmarks/cuda_checks.py
# Issue 39: the 136M GPT, host-bound on a fast GPU; stages 1-2 <= 1.05x DDP, stage 3 <= 1.30x and <= FSDP2 (all met
# on the H200 on 2026-12-04 once stage 3's repeated post-backwards under torch 2.11 were skipped). Two interleaved
# rounds (one round's ratio moved by 30-90% between calls); the host profile and the host's waits of round 0.
part 136m 240 "$PY" benchmarks/bench_gpu.py --part throughput --systems ddp,fsdp2,zero1,zero2,zero3 \
    --rounds 2 --steps 15 --warmup 5 --host-profile-steps 3 --sync-steps 1
# Issue 39: where stage 3's training thread waits on the 136M GPT, beside FSDP2's (the profiler's lanes, timeline.py).
part profile_136m 80 "$PY" benchmarks/bench_gpu.py --part profile --profile-dir "$PROFILES" --systems zero3,fsdp2 \
    --steps 3 --warmup 5
# Issue 40: the delayed update at batch 32 x 1024, where forward and backward outlast the host step.
part batch32_delay 130 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --batch-size 32 --rounds 1 \
    --steps 2 --warmup 1 --systems ddp,zero2+offload_delay
# Issue 40: exact overlap <= 1.3x DDP at batch 32 x 1024 (met on the H200 on 2026-12-04: 1.13x).
part batch32 90 "$PY" benchmarks/bench_gpu.py --part throughput --model "$LARGE" --batch-size 32 --rounds 1 \
    --steps 3 --warmup 1 --systems ddp,zero2+offload
