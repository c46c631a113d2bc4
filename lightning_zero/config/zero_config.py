"""Typed, validated settings for :class:`~lightning_zero.ZeroStrategy`.

Every check here runs when the strategy object is built, on every rank, before any process group exists:
a bad value must fail fast with a message naming the setting, never surface later as a hang inside a
collective.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Literal, Union

from torch import nn

from lightning_zero.config.choices import ZeroConfigError, check_choice, check_compile
from lightning_zero.config.compression import Compression, CompressionScope, QuantizationScheme, check_compression
from lightning_zero.config.memory_size import parse_bytes

StateDictType = Literal["sharded", "full"]
StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
OptimizerStateDtype = Literal["fp32", "bf16"]
PipelineSplit = Union[Literal["layers", "params"], list[int], list[str]]
#: A sharding group's size: a number of consecutive ranks, or "node" (the ranks of one node).
ShardSize = Union[int, Literal["node"], None]

#: What a user may pass to pick modules: one class, several classes, or a predicate on modules.
ModulePolicy = Union[type[nn.Module], Iterable[type[nn.Module]], Callable[[nn.Module], bool], None]

SUPPORTED_STAGES = (1, 2, 3)
#: ``stage``: a ZeRO stage, or ``"auto"`` (the planner chooses at setup).
Stage = Union[int, Literal["auto"]]
AUTO = "auto"

#: Selective updates' defaults: the share of columns stepped on the device (ZenFlow's published range is 5-10%), and
#: how many update intervals pass between choices of them.
DEFAULT_TOPK_RATIO = 0.1
SELECT_EVERY_INTERVALS = 4

#: Every ``pipeline_schedule`` (``pipeline/schedule.py`` maps each to its ``torch.distributed.pipelining`` class).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
#: Several stages per rank, rank ``r`` of ``p`` running stages ``r, r + p, r + 2p, ...`` (``pipeline_virtual_stages``).
LOOPED_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")
#: Exactly two stages per rank in a V: rank ``r`` of ``p`` runs stages ``r`` and ``2p - 1 - r``, so the first and the
#: last stage share rank 0.
V_SCHEDULES = ("zbv", "dualpipev")

#: Why ``shard_size`` / ``secondary_shard_size`` do not combine with pipeline stages.
PIPELINE_HYBRID_REFUSAL = (
    "each stage is already sharded over its data-parallel ranks only (one per pipeline replica), and sharding those "
    "again in groups would need a 3-D mesh (pipeline x replicate x shard) that is not implemented. Drop one of the two "
    "settings (more pipeline stages also shrink each stage's data-parallel group, and what crosses nodes)."
)

#: ``Trainer(strategy=name)`` -> the ``ZeroStrategy`` arguments it stands for (after ``import lightning_zero``).
REGISTERED_STRATEGIES: dict[str, dict[str, Any]] = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero1_offload": dict(stage=1, offload_optimizer=True),
    "zero2_offload": dict(stage=2, offload_optimizer=True),
    # ZeRO-Offload's delayed parameter update: inexact by design (``engine/offload/schedule.py``).
    "zero2_offload_delay": dict(stage=2, offload_optimizer=True, offload_step_delay=1),
    # ZenFlow's selective updates: inexact by design (``engine/offload/selective.py``).
    "zero2_offload_selective": dict(stage=2, offload_optimizer=True, offload_update_interval=4),
    "zero3": dict(stage=3),
    "zero3_offload_optimizer": dict(stage=3, offload_optimizer=True),
    "zero3_offload": dict(stage=3, offload_optimizer=True, offload_params=True),
    # Across nodes: shard inside each node, replicate across nodes (hybrid sharding), or ZeRO++ hpZ.
    "zero1_hsdp": dict(stage=1, shard_size="node"),
    "zero2_hsdp": dict(stage=2, shard_size="node"),
    "zero3_hsdp": dict(stage=3, shard_size="node"),
    "zero3_hpz": dict(stage=3, secondary_shard_size="node"),
    # Communication compression (ZeRO++ qgZ, and qwZ at stage 3) with error feedback on the gradients.
    "zero2_compressed": dict(stage=2, gradient_compression="int8", error_feedback=True),
    "zero3_compressed": dict(stage=3, gradient_compression="int8", error_feedback=True, param_compression="int8"),
    # The planner chooses the stage, offload, checkpointing and micro-batch when fit starts (strategy/auto_choice.py).
    "zero_auto": dict(stage="auto"),
}


def virtual_stages(schedule: str, virtual: int | None) -> int:
    """Stages per rank: ``virtual`` for a looped schedule (2 unless set), 2 for a V, else 1."""
    if schedule in LOOPED_SCHEDULES:
        return 2 if virtual is None else virtual
    return 2 if schedule in V_SCHEDULES else 1


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """The settings of one ZeroStrategy, validated on construction."""

    stage: Stage = 2
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters. ``"auto"``: the planner chooses the
    stage, the offload shares, activation checkpointing and the micro-batch when ``fit`` starts, within
    ``device_memory`` (``strategy/auto_choice.py``); every other setting given is kept as a constraint."""

    device_memory: int | str | None = None
    """``stage="auto"``: the memory per device to fit (bytes, or text such as ``"70GiB"``). ``None``: the device's free
    memory, the smallest over the ranks (on a CPU run: the host's available memory per rank)."""

    memory_headroom: float = 0.1
    """``stage="auto"``: the share of ``device_memory`` left free for what the prediction does not see (allocator
    fragmentation, the framework's own buffers); a choice whose fit measures more than its prediction over its second
    optimizer step, by more than this share, is warned about."""

    offload_optimizer: bool | float = False
    """Keep master shards and optimizer state in host memory (ZeRO-Offload): gradient shards go to the host,
    the optimizer steps there, updated shards come back. A number ``r`` in (0, 1] offloads that share of them
    (DeepSpeed's ``ratio``), whole parameters at a time; the rest stays on the device
    (``engine/offload/masters.py``)."""

    offload_params: bool = False
    """Stage 3 only: keep sharded parameters in host memory between uses, copying each unit's shards to the
    device just before its all-gather. The optimizer then steps on the host as well, so this implies
    ``offload_optimizer``."""

    offload_step_delay: int = 0
    """``1``: ZeRO-Offload's delayed parameter update (stages 1-2, ``offload_optimizer=True``): the host step of step
    ``t`` runs while step ``t + 1`` computes with the parameters of step ``t - 1``, hiding the host step behind the
    device's work. Not exact (each gradient updates parameters one step newer than those it was taken at);
    checkpoints and resumes are. Costs a second host gradient buffer. ``0``: the exact step ([Note: the delayed
    update] in ``engine/offload/schedule.py``)."""

    optimizer_state_dtype: OptimizerStateDtype = "fp32"
    """``"bf16"``: hold the optimizer's per-element state (Adam's moments, SGD's momentum) in bf16 between steps, at
    every stage, on the device or the host; the masters stay fp32 and each step computes in fp32 on a widened tile of
    the state, rounding it back to nearest once (4 bytes a parameter fewer for Adam, 8 fewer moved by each host step).
    Inexact by design ([Note: bf16 optimizer states] in ``engine/state_dtype.py``, ``docs/optimizer_states.md``).
    DeepSpeed's ``bf16.bf16_optimizer_states``. ``"fp32"``: as the optimizer makes it."""

    offload_update_interval: int = 1
    """``k > 1``: selective updates (DeepSpeed ZenFlow's idea; stages 1-2, ``offload_optimizer=True``, Adam or AdamW).
    Each step the ``offload_topk_ratio`` share of every matrix's columns with the largest gradient norms is stepped on
    the device, with its optimizer state there; the other columns' gradients accumulate in host memory and the host
    steps them every ``k`` steps in the background, landing on the device at a fixed step (an interval later, or at
    once: ``offload_overlap_step``). Inexact by design ([Note: selective updates] in ``engine/offload/selective.py``,
    ``docs/offload.md``); checkpoints and resumes are exact. ``1``: every column every step, as the optimizer steps
    it."""

    offload_topk_ratio: float | None = None
    """The share of each matrix's columns stepped on the device every step when ``offload_update_interval > 1``, in
    (0, 1); ``None``: 0.1. DeepSpeed's ``zenflow.topk_ratio``."""

    offload_select_interval: int | None = None
    """Steps between choices of the device's columns when ``offload_update_interval > 1``, a multiple of it (a choice is
    made at an interval's last step, from its gradient's column norms). ``None``: every 4 update intervals. DeepSpeed's
    ``zenflow.select_interval``."""

    offload_overlap_step: bool = True
    """Selective updates' host step overlaps the device's next ``offload_update_interval`` steps and lands after them
    (ZenFlow's ``overlap_step``); False: it lands at once, the step waiting for it, so no update is stale from the
    landing and the host's time is spent once every ``offload_update_interval`` steps instead of hidden."""

    pin_memory: bool | None = None
    """Pin offloaded host memory for fast asynchronous copies. ``None``: pin when an accelerator exists (on a
    CPU-only run pinning is impossible and ``True`` is ignored with a warning)."""

    activation_checkpointing: Any = None
    """Module classes, a predicate or a dict (``{"classes": [...], "every": k}``) whose forward is recomputed in
    backward instead of storing activations."""

    offload_activations: bool = False
    """Keep the inputs the ``activation_checkpointing`` modules save in host memory between forward and their
    recomputation, fetched back one module ahead (DeepSpeed's ``cpu_checkpointing``): exact, and the device keeps
    no block's hidden state across the step ([Note: offloaded checkpoint inputs] in
    ``activation_checkpointing/offload.py``, ``docs/long-context.md``)."""

    tiled_compute: bool | int = False
    """Compute a Hugging Face causal LM's MLPs, and its LM head with the loss, in sequence tiles with recomputation,
    so neither the MLP's ``[T, 4d]`` intermediate nor the ``[T, vocab]`` logits exist whole (ALST's TiledMLP and
    tiled loss): exact up to the order of fp32 sums; a training step's output then has no ``logits`` ([Note: tiling
    a Hugging Face causal LM] in ``tiled_compute/causal_lm.py``, ``docs/long-context.md``). ``True``: tiles of the
    hidden size's positions for the MLPs and of 2**24 logits for the loss; an integer: that many positions a tile.
    Other modules call ``lightning_zero.tiled_forward`` and ``tiled_cross_entropy`` themselves."""

    sequence_parallel_size: int = 1
    """Ranks that share each sample (Ulysses sequence parallelism, DeepSpeed's ``sequence_parallel_size``): each holds
    ``T / k`` of its positions, attention exchanges heads for positions with two all-to-alls, and ZeRO still shards
    over every rank, so the data-parallel degree is ``world_size / k`` ([Note: Ulysses sequence parallelism] in
    ``sequence_parallel/__init__.py``, ``docs/long-context.md``). 1: off."""

    wrap_policy: ModulePolicy = None
    """Stage 3 only: the modules that become one all-gather unit. ``None`` picks every element of an
    ``nn.ModuleList`` (the transformer blocks of most models); the root module is always a unit."""

    pipeline_stages: int = 1
    """Ranks per pipeline: the model (its ``pipeline_layers()``) is cut into this many stages, one per rank
    (``pipeline_stages x pipeline_virtual_stages`` with a looped or V-shaped schedule, several per rank), and the
    processes form ``world_size / pipeline_stages`` data-parallel replicas of that pipeline, across which ZeRO
    shards each stage: optimizer state (stage 1), and gradients (stage 2), and parameters (stage 3, FSDP2 over
    the stage's replicas)."""

    microbatches: int | None = None
    """Micro-batches each batch is cut into for the pipeline schedule; must divide the per-replica batch size.
    ``None``: one per pipeline stage (``pipeline_stages x pipeline_virtual_stages``). More micro-batches shrink
    the idle share of a step, ``(p - 1) / (m + p - 1)``."""

    pipeline_schedule: PipelineSchedule = "1f1b"
    """``torch.distributed.pipelining`` schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"``
    (same bubble, activations of at most ``p`` micro-batches alive), ``"interleaved_1f1b"`` (several virtual
    stages per rank, a smaller bubble for more point-to-point traffic), or a zero-bubble schedule, which splits
    each backward into the input gradient (on the critical path) and the weight gradient (filling the idle
    slots): ``"interleaved_zb"`` (looped stages, as interleaved_1f1b), ``"zbv"`` and ``"dualpipev"`` (two stages
    per rank in a V; dualpipev needs at least ``2 x pipeline_stages`` micro-batches)."""

    pipeline_split: PipelineSplit = "layers"
    """Where the layers are cut: ``"layers"`` (the same number of layers per stage), ``"params"`` (stages with
    parameter counts as equal as possible) or explicit split points, the index or (for an ``nn.Sequential``)
    the name of the first layer of every stage but the first."""

    pipeline_virtual_stages: int | None = None
    """Stages per rank for ``"interleaved_1f1b"`` and ``"interleaved_zb"`` (``None``: 2); 2 for ``"zbv"`` and
    ``"dualpipev"``; exactly 1 for the other schedules."""

    shard_size: ShardSize = None
    """Hybrid sharding: shard over groups of this many consecutive ranks and replicate across the groups
    (``"node"``: a group is a node, the Trainer's ``devices``). ``None`` shards over every rank. Each group's
    reduce-scatter and all-gather stay inside it; across groups only an all-reduce of each rank's gradient
    shard travels (``2P/k`` elements per rank per step for a group of ``k``, against ``2P`` for flat sharding),
    and each rank holds the ZeRO formulas' state with ``N`` replaced by ``k``. Every stage; DeepSpeed's
    ``mics_shard_size``. Not with ``pipeline_stages > 1``."""

    secondary_shard_size: ShardSize = None
    """Stage 3 only, ZeRO++ hpZ: after forward keep each layer's parameters sharded over groups of this many
    consecutive ranks (``"node"``: a node) instead of freeing them, so backward's all-gather stays inside the
    group. Costs that copy (``P/s`` parameters in the compute dtype between forward and backward). Must divide
    the world size; not with ``shard_size``. DeepSpeed's ``zero_hpz_partition_size``."""

    bucket_size_mb: float = 25.0
    """Size of one gradient communication bucket (stages 1-2); larger buckets mean fewer, bigger collectives."""

    unit_size_mb: float = 100.0
    """Stage 3: adjacent layers of ``wrap_policy`` (the blocks of a ``ModuleList``) share one FSDP2 unit while
    their parameters, in the dtype they are gathered in, fit in this many MiB: one all-gather, one
    reduce-scatter and one set of hooks per group instead of per layer, and under mixed precision one fp32
    unit for the group's norm layers instead of one per layer. A model of many small layers then stops paying
    FSDP2's per-unit host work on every step, for up to this much more memory gathered at once (twice, with
    prefetching). A layer larger than this is a unit of its own; ``0`` keeps one unit per layer (FSDP2's
    layout). [Note: merged units] in ``engine/stage3/fsdp2.py``."""

    overlap_comm: bool = True
    """Launch each bucket's reduce-scatter as soon as its gradients are ready, overlapping backward; with
    ``offload_optimizer`` and no loss scaler, also start each part's host step during backward (stages 1-3, see
    [Note: the host step during backward] in ``engine/offload/schedule.py``), under Lightning's clipping by norm
    speculatively ([Note: speculative clipping] in ``engine/offload/speculation.py``)."""

    reduce_every_microbatch: bool = False
    """Under gradient accumulation, reduce-scatter on every micro-batch instead of only the last, so full
    gradients never outlive one backward in stages 2 and 3 (less memory, k times the gradient traffic). At stage 3
    it also reshards each unit after every forward and backward, where by default an accumulation window keeps the
    units gathered from its first forward to its last backward (one all-gather a window instead of two a
    micro-batch: [Note: gathered accumulation windows] in ``engine/stage3/fsdp2_window.py``)."""

    gradient_compression: Compression | None = None
    """How gradients travel in the reduce-scatter (stages 1-3) and, under hybrid sharding, the sum across replica
    groups. ``"fp16"``/``"bf16"``: chunks travel in that dtype and each rank sums what it receives in fp32 (unlike
    ``ZeroPrecision(reduce_dtype=...)``, the dtype the collective itself sums in). ``"int8"``/``"int4"``: block-wise
    quantized chunks (ZeRO++ qgZ), an all-to-all after which the rank owning the rows dequantizes and sums them
    in fp32. ``None``: as computed. DeepSpeed's ``compression`` block and ``zero_quantized_gradients`` set it."""

    param_compression: Compression | None = None
    """How updated parameters travel in the stage 1-2 post-step all-gather and stage 3's forward/backward
    all-gathers (``"int8"``: ZeRO++ qwZ). fp32 master weights and the optimizer stay exact; every rank computes with
    the same dequantized weights. A 16-bit choice sends a tensor already 16-bit (bf16-mixed runs) as it is."""

    quantization_scheme: QuantizationScheme = "symmetric"
    """int8/int4 blocks carry an fp32 scale (``"symmetric"``) or a scale and a zero point (``"asymmetric"``, closer
    for blocks not centred on zero)."""

    quantization_block_size: int = 2048
    """Elements per quantization block sharing one scale: smaller blocks follow outliers more closely and send
    more scale bytes. An even integer >= 2 (int4 packs two per byte)."""

    error_feedback: bool = False
    """Keep each rank's gradient quantization residual and add it to the next step's gradient, so the applied
    updates track the exact ones over steps instead of drifting. Needs int8/int4 gradients; saved in checkpoints."""

    compression_scope: CompressionScope = "all"
    """``"all"``: every collective named above; ``"inter_node"``: only the gradient sum between the replica groups
    of hybrid sharding (``shard_size``), where bandwidth is scarce, leaving traffic inside a group exact."""

    elementwise_optimizers: tuple[type, ...] = ()
    """Extra optimizer classes you vouch update every element independently (beyond torch's SGD, Adam,
    AdamW, ...), so stepping each rank's shard separately is exact."""

    matrix_optimizers: tuple[type, ...] = ()
    """Extra optimizer classes (beyond ``torch.optim.Muon`` and ``Adafactor``) that need whole parameters: each
    parameter is stepped whole on one owner rank, which alone holds its state (``engine/owner_step.py``)."""

    compile: bool | dict[str, Any] = False
    """``torch.compile`` each block in place once sharded; a dict: torch.compile's arguments (``compiling.py``)."""

    state_dict_type: StateDictType = "sharded"
    """``"sharded"`` writes a directory of per-rank shards; ``"full"`` writes one file from rank 0."""

    init_weights: str | None = None
    """Pretrained weights to start from: a Hugging Face ``save_pretrained`` directory (safetensors, sharded or
    not), a ``.safetensors`` file, or a plain ``state_dict`` / consolidated / Lightning checkpoint file. Read
    after sharding, each rank only its rows (see ``pretrained/loading.py``); a ``ckpt_path`` resume overrides it."""

    init_weights_strict: bool = True
    """Whether keys of the module missing from ``init_weights`` (or of the file missing from the module) are an
    error, as ``load_state_dict(strict=True)``; shape mismatches always are."""

    init_weights_prefix: str | None = None
    """Prefix of the module's ``state_dict`` names that the file's keys go under (e.g. ``"model."``); ``None``
    picks the submodule that matches the most keys."""

    gather_16bit_weights_on_save: bool = False
    """Every ``save_checkpoint`` also writes the consolidated weights in the run's 16-bit dtype (bf16 unless the
    run is ``16-mixed``) to ``<checkpoint path>.hf/``: a Hugging Face directory (``config.json`` +
    ``model.safetensors``) when the module holds a ``transformers`` model, else ``model.safetensors`` alone.
    DeepSpeed's ``gather_16bit_weights_on_model_save`` (either spelling) sets it."""

    async_save: bool = False
    """Write sharded checkpoints in the background (``torch.distributed.checkpoint.async_save``): a save blocks
    training only while this rank's shards are copied to host memory, and the checkpoint appears under its
    name once every rank's files are written. Costs one host copy of this rank's shards, kept for reuse. The
    next save, the end of training and teardown wait for it (giving up when its files stop growing for
    ``timeout``) and raise its failure on every rank; ``save_top_k`` removals wait for it to succeed. Saves
    outside ``fit`` are synchronous. Needs ``state_dict_type="sharded"``."""

    process_group_backend: str | None = None
    """``torch.distributed`` backend; ``None`` picks ``nccl`` on CUDA and ``gloo`` otherwise."""

    timeout: timedelta | float = timedelta(seconds=60)
    """The hang limit: how long a collective may wait for a peer while a run's loops run before every rank
    fails with an error naming the rank and the collective (a ``timedelta`` or a number of seconds). A rank
    that fails, dies, finishes early or diverges is named sooner. The rendezvous and setup (before the loops)
    allow at least 10 minutes. For a known one-sided long phase, use ``lightning_zero.faults.extended``."""

    watchdog: bool = True
    """Run the collective watchdog thread (``lightning_zero/faults/``): it names the rank and collective of a
    hang, ends blocked ranks (also under NCCL, where nothing raises), makes a rank that finished early fail,
    and ends the process within 30 s of SIGTERM. ``False`` keeps only the process-group timeout."""

    start_method: StartMethod = "popen"
    """How Lightning starts the processes: re-run the script (``popen``) or ``spawn``/``fork``/``forkserver``."""

    auto_resume: bool = True
    """When a launcher restarts a failed job (``torchrun --max-restarts``: ``TORCHELASTIC_RESTART_COUNT`` > 0, or
    the newest checkpoint was written by this torchrun job; SLURM: ``SLURM_RESTART_COUNT`` > 0) and ``fit`` got
    no ``ckpt_path``, resume from the newest complete checkpoint in the trainer's ``ModelCheckpoint`` directories
    (set ``dirpath``: without it the directory follows the logger's version, which changes on restart; see
    ``lightning_zero/resume/``). Every rank resumes from the same checkpoint, mid-epoch exactly. ``False``: a
    restart starts from the beginning. (Either way, on SIGTERM ``sigterm.ckpt`` is saved into the first
    ``ModelCheckpoint``'s directory when that is safe, for a resume or ``ckpt_path="last"``.)"""

    def __post_init__(self) -> None:
        check_choice("stage", self.stage, (*SUPPORTED_STAGES, AUTO))
        self._check_auto()
        if self.init_weights is not None:
            if not isinstance(self.init_weights, (str, os.PathLike)) or not os.path.exists(self.init_weights):
                raise ZeroConfigError(
                    f"`init_weights={self.init_weights!r}` must be the path of a `save_pretrained` directory, a "
                    ".safetensors file or a state_dict file, and it does not exist."
                )
            object.__setattr__(self, "init_weights", os.fspath(self.init_weights))
        if self.init_weights_prefix is not None and not isinstance(self.init_weights_prefix, str):
            raise ZeroConfigError(f"`init_weights_prefix` must be None or a string, got {self.init_weights_prefix!r}.")
        flags = (
            "offload_params",
            "overlap_comm",
            "reduce_every_microbatch",
            "init_weights_strict",
            "gather_16bit_weights_on_save",
            "watchdog",
            "async_save",
            "auto_resume",
            "error_feedback",
            "offload_activations",
        )
        for flag in flags:
            if not isinstance(getattr(self, flag), bool):
                raise ZeroConfigError(f"`{flag}` must be True or False, got {getattr(self, flag)!r}.")
        if isinstance(self.bucket_size_mb, bool) or not isinstance(self.bucket_size_mb, (int, float)):
            raise ZeroConfigError(f"`bucket_size_mb` must be a positive number of MiB, got {self.bucket_size_mb!r}.")
        if not self.bucket_size_mb > 0:
            raise ZeroConfigError(f"`bucket_size_mb` must be a positive number of MiB, got {self.bucket_size_mb}.")
        if (
            isinstance(self.unit_size_mb, bool)
            or not isinstance(self.unit_size_mb, (int, float))
            or not self.unit_size_mb >= 0
        ):
            raise ZeroConfigError(
                f"`unit_size_mb` must be a number of MiB >= 0 (0: one unit per layer), got {self.unit_size_mb!r}."
            )
        if not isinstance(self.pipeline_stages, int) or self.pipeline_stages < 1:
            raise ZeroConfigError(f"`pipeline_stages` must be an integer >= 1, got {self.pipeline_stages!r}.")
        self._check_offload()
        self._check_selective()
        tiles = self.tiled_compute
        if not isinstance(tiles, bool) and (not isinstance(tiles, int) or tiles < 1):
            raise ZeroConfigError(
                f"`tiled_compute` must be True, False or a positive number of positions per tile, got {tiles!r}."
            )
        self._check_sequence_parallel()
        if self.offload_activations and not self.activation_checkpointing:
            raise ZeroConfigError(
                "`offload_activations=True` moves the inputs activation checkpointing keeps to host memory: set "
                "`activation_checkpointing=` too (e.g. activation_checkpointing=YourBlock)."
            )
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise ZeroConfigError(f"`microbatches` must be None or an integer >= 1, got {self.microbatches!r}.")
        check_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        self._check_pipeline()
        self._check_shard_sizes()
        check_compression(self)
        check_choice("state_dict_type", self.state_dict_type, ("sharded", "full"))
        if self.async_save and self.state_dict_type != "sharded":
            raise ZeroConfigError(
                "`async_save=True` writes sharded checkpoints (each rank its own shards, in the background); "
                f"`state_dict_type={self.state_dict_type!r}` has rank 0 write the whole model. Use "
                "state_dict_type='sharded' (then `lightning-zero consolidate` for one file), or async_save=False."
            )
        check_choice("start_method", self.start_method, ("popen", "spawn", "fork", "forkserver"))
        if self.process_group_backend is not None:
            check_choice(
                "process_group_backend", self.process_group_backend, ("gloo", "nccl", "mpi", "cuda:nccl,cpu:gloo")
            )
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            if self.timeout > 0:  # seconds, as LightningCLI / YAML users write it
                object.__setattr__(self, "timeout", timedelta(seconds=self.timeout))
        if not isinstance(self.timeout, timedelta) or self.timeout.total_seconds() <= 0:
            raise ZeroConfigError(
                f"`timeout` must be a positive datetime.timedelta or number of seconds, got {self.timeout!r}."
            )
        if self.pin_memory is not None and not isinstance(self.pin_memory, bool):
            raise ZeroConfigError(f"`pin_memory` must be None, True or False, got {self.pin_memory!r}.")
        check_compile(self.compile)
        for name in ("elementwise_optimizers", "matrix_optimizers"):
            classes = getattr(self, name)
            if not isinstance(classes, (tuple, list)) or not all(isinstance(c, type) for c in classes):
                raise ZeroConfigError(f"`{name}` must be a tuple of optimizer classes, got {classes!r}.")
            object.__setattr__(self, name, tuple(classes))

    def _check_auto(self) -> None:
        """``device_memory`` and ``memory_headroom`` (normalised in place), which only ``stage="auto"`` reads."""
        memory: Any = self.device_memory
        headroom = self.memory_headroom
        if isinstance(memory, str):
            try:
                memory = parse_bytes(memory)
            except ValueError as err:
                raise ZeroConfigError(f"`device_memory`: {err}") from None
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float)) or memory <= 0):
            raise ZeroConfigError(
                f"`device_memory` must be None, a positive number of bytes or a size such as '70GiB', got {memory!r}."
            )
        if memory is not None:
            object.__setattr__(self, "device_memory", int(memory))
        if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 1:
            raise ZeroConfigError(f"`memory_headroom` must be a share in [0, 1), got {headroom!r}.")
        if self.stage == AUTO:
            if self.pipeline_stages > 1:
                raise ZeroConfigError(
                    f"`stage='auto'` plans a data-parallel run, not `pipeline_stages={self.pipeline_stages}` (each "
                    "pipeline stage holds part of the model and its own micro-batches). Name a stage (1, 2 or 3); "
                    "`lightning-zero plan` predicts each one's memory."
                )
            return
        for setting, given in (("device_memory", memory is not None), ("memory_headroom", headroom != 0.1)):
            if given:
                raise ZeroConfigError(
                    f"`{setting}` is what `stage='auto'` fits its choice into; with `stage={self.stage}` nothing reads "
                    f"it. Set stage='auto' (or Trainer(strategy='zero_auto')), or drop `{setting}`."
                )

    def _check_offload(self) -> None:
        """The offload settings, normalised in place (``offload_optimizer=1`` is ``True``)."""
        ratio = self.offload_optimizer
        if not isinstance(ratio, bool) and (not isinstance(ratio, (int, float)) or not 0 < ratio <= 1):
            raise ZeroConfigError(f"`offload_optimizer` must be True, False or a share in (0, 1], got {ratio!r}.")
        if not isinstance(ratio, bool):
            object.__setattr__(self, "offload_optimizer", True if ratio == 1 else float(ratio))
        if self.offload_params and self.stage not in (3, AUTO):
            raise ZeroConfigError(
                f"`offload_params=True` needs `stage=3` (got stage={self.stage}): only stage 3 shards parameters."
            )
        check_choice("optimizer_state_dtype", self.optimizer_state_dtype, ("fp32", "bf16"))
        delay = self.offload_step_delay
        check_choice("offload_step_delay", delay if not isinstance(delay, bool) else str(delay), (0, 1))
        if not delay:
            return
        if self.offload_optimizer is not True:
            raise ZeroConfigError(
                f"`offload_step_delay=1` runs the optimizer step on the host while the next step computes: it needs "
                f"`offload_optimizer=True` (every master on the host), got offload_optimizer={self.offload_optimizer!r}."
            )
        if self.stage == 3 or self.pipeline_stages > 1:  # with stage="auto": a constraint on the choice
            setting = f"stage={self.stage}" if self.stage == 3 else f"pipeline_stages={self.pipeline_stages}"
            raise ZeroConfigError(
                f"`offload_step_delay=1` is built for stages 1 and 2 without pipeline stages, not `{setting}`: use "
                "stage=1 or 2 with offload_optimizer=True, or offload_step_delay=0."
            )

    def _check_selective(self) -> None:
        """Selective updates' settings (see ``offload_update_interval``), normalised in place."""
        interval = self.offload_update_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ZeroConfigError(f"`offload_update_interval` must be an integer >= 1, got {interval!r}.")
        ratio, select = self.offload_topk_ratio, self.offload_select_interval
        if interval == 1:
            given = [
                name for name in ("offload_topk_ratio", "offload_select_interval") if getattr(self, name) is not None
            ]
            given += [] if self.offload_overlap_step else ["offload_overlap_step"]
            if given:
                raise ZeroConfigError(
                    f"`{given[0]}` applies to selective updates, which `offload_update_interval` > 1 switches on "
                    f"(got offload_update_interval={interval}). Set offload_update_interval=k (e.g. 4), or drop "
                    f"`{given[0]}`."
                )
            return
        if ratio is None:
            ratio = DEFAULT_TOPK_RATIO
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
            raise ZeroConfigError(f"`offload_topk_ratio` must be a share in (0, 1), got {ratio!r}.")
        if select is None:
            select = SELECT_EVERY_INTERVALS * interval
        if isinstance(select, bool) or not isinstance(select, int) or select < interval or select % interval:
            raise ZeroConfigError(
                f"`offload_select_interval` must be a multiple of offload_update_interval={interval} (the columns "
                f"change only between host steps), got {select!r}."
            )
        object.__setattr__(self, "offload_topk_ratio", float(ratio))
        object.__setattr__(self, "offload_select_interval", select)
        needs = {
            "offload_optimizer=True": self.offload_optimizer is True,
            "stage=1 or 2": self.stage in (1, 2, AUTO),
            "pipeline_stages=1": self.pipeline_stages == 1,
            "offload_step_delay=0": not self.offload_step_delay,
            "optimizer_state_dtype='fp32'": self.optimizer_state_dtype == "fp32",
            "no gradient or parameter compression": self.gradient_compression is None
            and self.param_compression is None,
        }
        missing = [need for need, met in needs.items() if not met]
        if missing:
            raise ZeroConfigError(
                f"`offload_update_interval={interval}` (selective updates) needs {', '.join(needs)}; this config "
                f"lacks: {', '.join(missing)}. Use offload_update_interval=1 for this configuration."
            )

    def _check_pipeline(self) -> None:
        """The pipeline settings, and how they combine with the checkpoint format."""
        split = self.pipeline_split
        if isinstance(split, str):
            check_choice("pipeline_split", split, ("layers", "params"))
        elif not isinstance(split, (list, tuple)) or not all(
            isinstance(x, (int, str)) and not isinstance(x, bool) for x in split
        ):
            raise ZeroConfigError(
                f"`pipeline_split` must be 'layers', 'params' or a list of layer indices or names, got {split!r}."
            )
        virtual = self.pipeline_virtual_stages
        if virtual is not None and (not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1):
            raise ZeroConfigError(f"`pipeline_virtual_stages` must be None or an integer >= 1, got {virtual!r}.")
        schedule = self.pipeline_schedule
        if schedule in LOOPED_SCHEDULES and virtual == 1:
            raise ZeroConfigError(
                f"`pipeline_schedule={schedule!r}` runs several stages per rank; set `pipeline_virtual_stages` "
                ">= 2 (or leave it None for 2), or use pipeline_schedule='1f1b'."
            )
        if schedule in V_SCHEDULES and virtual not in (None, 2):
            raise ZeroConfigError(
                f"`pipeline_schedule={schedule!r}` runs exactly 2 stages per rank (a V: rank r holds stages r and "
                f"2p-1-r); leave `pipeline_virtual_stages` None (or 2), got {virtual}."
            )
        if schedule not in (*LOOPED_SCHEDULES, *V_SCHEDULES) and virtual not in (None, 1):
            raise ZeroConfigError(
                f"`pipeline_virtual_stages={virtual}` needs a schedule with several stages per rank "
                f"({', '.join(repr(s) for s in (*LOOPED_SCHEDULES, *V_SCHEDULES))}); {schedule!r} runs one stage per rank."
            )
        stages = self.pipeline_stages * virtual_stages(schedule, virtual)
        if schedule == "dualpipev" and self.microbatches is not None and self.microbatches < stages:
            raise ZeroConfigError(
                f"`pipeline_schedule='dualpipev'` needs at least as many micro-batches as stages ({stages} = 2 x "
                f"pipeline_stages); got `microbatches={self.microbatches}`."
            )
        if self.pipeline_stages == 1:
            return
        if self.state_dict_type == "full":
            raise ZeroConfigError(
                "`state_dict_type='full'` is not available with `pipeline_stages > 1` (each stage's ranks hold only its "
                "layers); use 'sharded' (the default), whose directory loads into a run with or without pipelining, "
                "and `lightning-zero consolidate` for one plain file."
            )

    def _check_shard_sizes(self) -> None:
        for setting in ("shard_size", "secondary_shard_size"):
            value = getattr(self, setting)
            if isinstance(value, str) and value.isdigit():  # "2" from a command line
                object.__setattr__(self, setting, value := int(value))
            if (
                value is None
                or value == "node"
                or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
            ):
                continue
            raise ZeroConfigError(
                f"`{setting}` must be None, 'node' or a number of ranks (1 only in one process), got {value!r}."
            )
        if self.secondary_shard_size is not None and self.stage not in (3, AUTO):
            raise ZeroConfigError(
                f"`secondary_shard_size={self.secondary_shard_size!r}` (hpZ) needs `stage=3` (got stage={self.stage}): "
                "stages 1-2 keep whole parameters on every rank, so there is no parameter gather to keep in a node."
            )
        if self.secondary_shard_size is not None and self.shard_size is not None:
            raise ZeroConfigError(
                "`secondary_shard_size` (hpZ) and `shard_size` (hybrid sharding) cannot be combined: with a "
                "`shard_size` group inside a node every gather already stays there. Choose one."
            )
        for setting in ("shard_size", "secondary_shard_size"):
            if getattr(self, setting) is not None and self.pipeline_stages > 1:
                raise ZeroConfigError(
                    f"`{setting}={getattr(self, setting)!r}` is not supported with `pipeline_stages="
                    f"{self.pipeline_stages}`: {PIPELINE_HYBRID_REFUSAL}"
                )

    def _check_sequence_parallel(self) -> None:
        size = self.sequence_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ZeroConfigError(f"`sequence_parallel_size` must be an integer >= 1 (1: off), got {size!r}.")
        if size == 1:
            return
        refused = {
            "pipeline_stages": self.pipeline_stages > 1,
            "shard_size": self.shard_size is not None,
            "secondary_shard_size": self.secondary_shard_size is not None,
            "compile": self.compile is not False,
        }
        for setting, given in refused.items():
            if given:
                raise ZeroConfigError(
                    f"`sequence_parallel_size={size}` cannot be combined with `{setting}={getattr(self, setting)!r}` "
                    "yet: sequence parallelism shards ZeRO over every rank of a plain data-parallel world, eagerly."
                )

    def group_sizes(self, world_size: int, node_size: int) -> tuple[int, int | None]:
        """``(shard group size, hpZ group size or None)`` for a run of ``world_size`` ranks in nodes of
        ``node_size``, or a :class:`ZeroConfigError` naming the setting; checked before any process group exists."""
        shard = self._group_size("shard_size", self.shard_size, world_size, node_size) or world_size
        secondary = self._group_size("secondary_shard_size", self.secondary_shard_size, world_size, node_size)
        for setting, size in (("shard_size", shard), ("secondary_shard_size", secondary)):
            if size == 1 and world_size > 1:
                raise ZeroConfigError(
                    f"`{setting}` comes to 1 rank (of {world_size}): nothing would be sharded. Use a group of >= 2 "
                    "ranks, None (every rank), or Lightning's 'ddp' for plain replication."
                )
        return shard, secondary

    @staticmethod
    def _group_size(setting: str, value: ShardSize, world_size: int, node_size: int) -> int | None:
        if value is None:
            return None
        if value == "node":
            if node_size < 1 or world_size % node_size:
                raise ZeroConfigError(
                    f"`{setting}='node'` needs the same number of ranks on every node, but {world_size} ranks do not "
                    f"split into nodes of {node_size} (uneven cluster); give a number of ranks instead."
                )
            return node_size
        if value > world_size or world_size % value:
            divisors = [d for d in range(2, world_size + 1) if world_size % d == 0]
            relation = "is larger than" if value > world_size else "does not divide"
            raise ZeroConfigError(
                f"`{setting}={value}` {relation} the world size {world_size} (num_nodes x devices); choose one of "
                f"{divisors}, 'node' or None."
            )
        return value

    @property
    def timeout_delta(self) -> timedelta:
        """``timeout`` as validated: a number of seconds became a ``timedelta`` in ``__post_init__``."""
        if not isinstance(self.timeout, timedelta):
            raise TypeError(f"`timeout` was not validated: {self.timeout!r}")
        return self.timeout

    @property
    def pipeline_virtual(self) -> int:
        """Stages per rank (2 for the looped schedules unless set, 2 for the V-shaped ones, else 1)."""
        return virtual_stages(self.pipeline_schedule, self.pipeline_virtual_stages)

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches per batch (one per pipeline stage unless set)."""
        return self.microbatches or self.pipeline_stages * self.pipeline_virtual

    @property
    def compresses(self) -> bool:
        """Whether any collective travels compressed (``gradient_compression`` or ``param_compression`` set)."""
        return self.gradient_compression is not None or self.param_compression is not None

    @property
    def chosen(self) -> bool:
        """Whether the stage is known: False for ``stage="auto"`` until the planner chooses, when ``fit`` starts (the
        readers below then answer as no configuration has chosen anything yet: nothing sharded, nothing offloaded)."""
        return self.stage != AUTO

    @property
    def chosen_stage(self) -> int:
        """The stage, where it is known (what builds an engine reads)."""
        if not isinstance(self.stage, int):
            raise RuntimeError("lightning_zero internal error: stage='auto' is chosen before anything is sharded")
        return self.stage

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: parameters become DTensor shards of FSDP2, in place. What the layers above ask before any engine
        exists: the module is built on the meta device and materialised a unit at a time, starts from rank 0's values
        as it is sharded (no broadcast), is sharded for evaluation too, and only a run that shards parameters can take
        it up later. Once it exists, the engine answers (``ShardingEngine.gathered_units``)."""
        return self.stage == 3

    @property
    def optimizer_on_host(self) -> bool:
        """Whether the optimizer state lives in host memory (``offload_params`` puts it there too)."""
        return bool(self.offload_optimizer) or self.offload_params

    @property
    def bucket_numel(self) -> int:
        """Elements of one fp32 gradient bucket."""
        return max(1, int(self.bucket_size_mb * 2**20) // 4)
