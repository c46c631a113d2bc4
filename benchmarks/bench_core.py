"""Core benchmark: one GPT, five data-parallel systems, same hardware, same batch.

    python benchmarks/bench_core.py                              # all systems, ~27M-param GPT
    python benchmarks/bench_core.py --systems ddp,fsdp2 --quick  # tiny model smoke test
    python benchmarks/bench_core.py --precision bf16-mixed        # the same five systems in bf16-mixed
    python benchmarks/bench_core.py --systems ddp,zero1,zero2,zero3 --optimizer muon  # torch.optim.Muon + AdamW

Systems (2 CPU ranks, AdamW, batch 8 per rank, random tokens; ``--precision`` 32-true or bf16-mixed):

    ddp     Lightning "ddp" (bf16-mixed: Lightning's autocast plugin, fp32 weights and gradients)
    fsdp2   Lightning ModelParallelStrategy + torch.distributed.fsdp.fully_shard per Block, then root
            (bf16-mixed: MixedPrecisionPolicy(param_dtype=bf16), FSDP2's default bf16 reduction, autocast)
    zero1   lightning_zero.ZeroStrategy(stage=1)
    zero2   lightning_zero.ZeroStrategy(stage=2)
    zero3   lightning_zero.ZeroStrategy(stage=3)

    fsdp2_hsdp  FSDP2 with a 2-D mesh (replicate x shard): shards inside each node, replicates across nodes
                (torch's HSDP; Lightning's ModelParallelStrategy has no replicate dimension, so the module
                builds the mesh itself)

    and variants by suffix: ``zero2+hsdp2`` (``shard_size=2``: hybrid sharding over groups of 2 ranks),
    ``zero3+hpz2`` (``secondary_shard_size=2``: ZeRO++ hpZ), ``zero2+ac`` (activation checkpointing of every Block, ``+ac2`` every
    second), ``zero1+offload`` / ``zero2+offload`` / ``zero3+offload`` (``offload_optimizer=True``),
    ``zero3+offload_params`` (``offload_params=True`` too), ``zero2+offload_delay`` (``offload_step_delay=1`` too). The offload benchmark of the README:

    python benchmarks/bench_core.py --systems zero1,zero1+offload,zero2,zero2+offload,zero3,zero3+offload,zero3+offload_params

Several nodes are simulated on this machine with ``--nodes``: each node is one Lightning launcher (``NODE_RANK``,
one shared ``MASTER_PORT``) starting ``--devices`` ranks, and collectives.py classifies each process group as
intra- or inter-node from that layout. The hybrid-sharding benchmark of the README (4 ranks as 2 nodes x 2):

    python benchmarks/bench_core.py --nodes 2 --devices 2 \
        --systems ddp,fsdp2,fsdp2_hsdp,zero1,zero1+hsdp2,zero2,zero2+hsdp2,zero3,zero3+hsdp2,zero3+hpz2

Each system runs in its own fresh subprocess (the script re-invokes itself with
``--system NAME``), so every run has a clean process group, its own peak RSS and no
leftover process-group state. Lightning's launcher then re-runs that command for the
other ranks. Rank 0 gathers every rank's measurements and writes one JSON line to
``--out``; the parent prints all JSON lines and then a table.

What is measured (see :class:`BenchCallback`):

* step time: wall time from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
  backward, gradient sync and optimizer step), median over the measured steps;
* model-state bytes right after backward, counted from outside the strategy: the
  module's parameters and ``.grad`` plus every tensor reachable from the optimizers
  (param groups, their grads, state), deduplicated by storage, DTensors by local shard;
* the ZeRO-paper formula for the same quantity (fp32 weights + fp32 grads + Adam's
  two fp32 moments = 16 bytes/param without sharding; bf16-mixed ZeRO: 2-byte weights and
  gradients, 12 bytes of fp32 master + Adam per parameter, sharded as the stage says);
* peak RSS of each rank process (``ru_maxrss``);
* bytes communicated per step: measured by ``lightning_zero``'s ``comm_stats`` for the
  ZeRO systems, analytic for ddp/fsdp2 (marked so), in the convention of
  ``lightning_zero/engine/comm/collectives.py``: a reduce-scatter counts its full input, an
  all-gather its full output, and an all-reduce is costed as the reduce-scatter +
  all-gather it amounts to. For fp32 that makes ddp 8P bytes, ZeRO-1/2 8P and ZeRO-3 12P
  (the ZeRO paper's 2P / 2P / 3P elements). Ring algorithms put (N-1)/N of it on the wire.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterable

# Make `import lightning_zero` work from a plain checkout (no `pip install -e .` needed).
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from host_profile import HostProfile  # noqa: E402  (benchmarks/, the script's own directory)
from phases import PhaseWindows  # noqa: E402

from lightning_zero.demo import GPTConfig, GPTLightningModule, RandomTokenDataModule, count_parameters  # noqa: E402
from lightning_zero.observability.monitor import ZeroMonitor  # noqa: E402
from lightning_zero.planning.accounting import live_tensor_bytes, saved_tensor_bytes  # noqa: E402
from lightning_zero.planning.accounting import model_state_bytes as placed_state_bytes  # noqa: E402
from lightning_zero.planning.formulas import CHOICES_BY_NAME, model_state_split  # noqa: E402

ALL_SYSTEMS = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
BASELINES = ("ddp", "fsdp2", "fsdp2_hsdp")
#: Suffixes for ZeRO systems (extra ZeroStrategy settings): "zero2+ac" checkpoints every Block, "zero2+ac2"
#: every second one; "zero2+offload" offloads the optimizer, "zero3+offload_params" the parameters too.
VARIANTS = {
    "": {},
    "ac": {"activation_checkpointing": {"classes": ["lightning_zero.demo.gpt.Block"]}},
    "ac2": {"activation_checkpointing": {"classes": ["lightning_zero.demo.gpt.Block"], "every": 2}},
    "offload": {"offload_optimizer": True},
    # ZeRO-Offload's delayed parameter update (stages 1-2): the host step runs while the next step computes.
    "offload_delay": {"offload_optimizer": True, "offload_step_delay": 1},
    "offload_params": {"offload_optimizer": True, "offload_params": True},
    # torch.compile (inductor) of each Block after sharding: compiled vs eager step time.
    "compile": {"compile": True},
    # The collective watchdog (on by default) switched off: benchmarks/bench_watchdog.py compares the two.
    "nowatchdog": {"watchdog": False},
    # Pipeline stages: the ranks form one pipeline of that many stages (1F1B, m micro-batches per batch), the
    # same global batch (each replica's batch is batch_per_rank x stages); e.g. "zero1+pp2m8".
    **{f"pp2m{m}": {"pipeline_stages": 2, "microbatches": m, "pipeline_schedule": "1f1b"} for m in (4, 8, 16)},
    # Hybrid sharding over groups of k consecutive ranks (a node when --devices is k), and ZeRO++ hpZ.
    **{f"hsdp{k}": {"shard_size": k} for k in (2, 4, 8)},
    **{f"hpz{k}": {"secondary_shard_size": k} for k in (2, 4, 8)},
}

# ~27M parameters: 6 x 12*512^2 in the blocks + 2 x 8192*512 for embedding and (untied) head.
FULL_MODEL = dict(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512)
QUICK_MODEL = dict(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=64)


# --------------------------------------------------------------------------- systems


class FSDP2GPTModule(GPTLightningModule):
    """The demo GPT sharded with FSDP2 (``fully_shard``), the torchtitan way.

    The model is built on the meta device, each ``Block`` becomes its own FSDP unit
    (gathered just before use, freed right after), then the root takes the remaining
    parameters (embeddings, final norm, head). ``ModelParallelStrategy.setup`` then
    materialises the local shards with ``to_empty`` + ``reset_parameters``. (On a CPU
    mesh DTensor warns that its random ops are not fully supported, so the shards'
    random init may not equal a slice of one full init; irrelevant for timing/memory.)
    """

    def configure_model(self) -> None:
        if self.model is not None:  # hook can run again (e.g. validate after fit)
            return
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            super().configure_model()
        assert self.model is not None
        mesh = self.device_mesh["data_parallel"]
        if getattr(self, "hsdp_shard_size", None):  # HSDP: (replicate, shard), shard inside a node
            from torch.distributed.device_mesh import init_device_mesh

            k = self.hsdp_shard_size
            mesh = init_device_mesh("cpu", (mesh.size() // k, k), mesh_dim_names=("replicate", "shard"))
        kwargs = {"mp_policy": self.mp_policy} if getattr(self, "mp_policy", None) is not None else {}
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(self.model, mesh=mesh, **kwargs)


class MuonGPTModule(GPTLightningModule):
    """``--optimizer muon``: ``torch.optim.Muon`` for the blocks' matrices and AdamW for the rest (embeddings,
    head, norms, biases), two optimizers in manual optimization, as Muon's users write it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        matrices = [p for n, p in self.named_parameters() if p.dim() == 2 and ".blocks." in f".{n}"]
        ids = {id(p) for p in matrices}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return (
            torch.optim.Muon(matrices, lr=0.02, weight_decay=0.01),
            torch.optim.AdamW(rest, lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas)),
        )

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()
        return loss


def build_strategy(system: str, devices: int) -> Any:
    if system == "ddp":
        return "ddp"
    if system in ("fsdp2", "fsdp2_hsdp"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        # "auto" would make data_parallel_size = num_nodes (1) and put both ranks on the
        # tensor-parallel axis; we want pure data parallelism across all ranks.
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    base, _, variant = system.partition("+")
    if base.startswith("zero") and base[4:] in ("1", "2", "3") and variant in VARIANTS:
        from lightning_zero import ZeroStrategy  # lazy: lets ddp/fsdp2 run before it exists

        return ZeroStrategy(stage=int(base[4:]), **VARIANTS[variant])
    raise ValueError(f"unknown system {system!r}; choose from {', '.join(ALL_SYSTEMS)}")


#: bench system name -> the estimator's choice (fsdp2 holds what ZeRO-3 holds)
_CHOICE_OF = {
    "ddp": "ddp",
    "fsdp2": "zero3",
    "fsdp2_hsdp": "zero3_hsdp",
    "zero1": "zero1",
    "zero2": "zero2",
    "zero3": "zero3",
    "zero1+offload": "zero1_offload",
    "zero2+offload": "zero2_offload",
    "zero3+offload": "zero3_offload_optimizer",
    "zero3+offload_params": "zero3_offload",
}


def pipeline_stages(system: str) -> int:
    """Ranks per pipeline of a system ("zero1+pp2m8": 2; 1 without pipelining)."""
    return VARIANTS.get(system.partition("+")[2], {}).get("pipeline_stages", 1)


def formula_bytes(system: str, P: int, N: int, precision: str = "32-true") -> float:
    """ZeRO paper's model-state memory per rank, device and host together (``lightning-zero estimate``'s)."""
    return sum(formula_split(system, P, N, precision))


def formula_split(system: str, P: int, N: int, precision: str = "32-true") -> tuple[float, float]:
    """(device, host) model-state bytes per rank, from :mod:`lightning_zero.planning.formulas`; activation
    checkpointing (``+ac``) changes activations only."""
    base, _, variant = system.partition("+")
    if variant.startswith("pp"):  # per stage: see BenchCallback.summarise
        return float("nan"), float("nan")
    if variant.startswith("hsdp") or system == "fsdp2_hsdp":  # the formulas with N -> k
        k = VARIANTS[variant]["shard_size"] if variant else N // _NODES
        name = "zero3_hsdp" if system == "fsdp2_hsdp" else f"{base}_hsdp"
        return model_state_split(CHOICES_BY_NAME[name], P, N, precision, devices_per_node=k)
    # hpZ's node-local copy lives between forward and backward, not after backward where state is counted.
    if variant == "offload_delay":  # the offload formula with the delayed update's second fp32 gradient shard
        choice = dataclasses.replace(CHOICES_BY_NAME[_CHOICE_OF[f"{base}+offload"]], offload_step_delay=1)
        return model_state_split(choice, P, N, precision)
    name = system if variant in ("offload", "offload_params") else base
    return model_state_split(CHOICES_BY_NAME[_CHOICE_OF[name]], P, N, precision)


#: Simulated nodes of the run (``--nodes``), for the formulas of fsdp2_hsdp.
_NODES = 1


def replica_all_reduce_bytes(P: int, precision: str, shard_size: int) -> int:
    """Hybrid sharding's only inter-node traffic: the all-reduce of each rank's P/k gradient shard (counted twice,
    as every all-reduce), in the reduce dtype."""
    return (2 if precision == "bf16-mixed" else 4) * 2 * P // shard_size


def analytic_comm_bytes(system: str, config: GPTConfig, precision: str = "32-true", shard_size: int = 2) -> int:
    """Per-rank collective volume per step, in collectives.py's convention (module docstring); ``shard_size``:
    the ranks of a node, fsdp2_hsdp's shard group."""
    P = count_parameters(config)
    width = 2 if precision == "bf16-mixed" else 4  # ZeRO and FSDP2 gather and reduce in bf16
    base, _, variant = system.partition("+")
    if system == "fsdp2_hsdp" or variant.startswith("hsdp"):  # flat traffic plus the all-reduce of each P/k shard
        k = VARIANTS[variant]["shard_size"] if variant else shard_size
        flat = analytic_comm_bytes("fsdp2" if system == "fsdp2_hsdp" else base, config, precision)
        return flat + replica_all_reduce_bytes(P, precision, k)
    system = base  # activation checkpointing recomputes and hpZ gathers elsewhere: neither communicates more
    if system == "ddp":
        return 8 * P  # one all-reduce of all (fp32, also under autocast) grads = reduce-scatter + all-gather
    if system in ("zero1", "zero2"):
        return 2 * width * P  # reduce-scatter grads + all-gather updated params
    if system == "zero3":
        return 3 * width * P  # all-gather (fwd) + all-gather (bwd) + reduce-scatter grads
    if system == "fsdp2":
        # Blocks: gather in forward, re-gather in backward, reduce-scatter grads. The root
        # unit (embeddings, ln_f, head) is not resharded after forward: gather once + RS.
        one_block = count_parameters(replace(config, n_layer=1)) - count_parameters(replace(config, n_layer=0))
        p_blocks = one_block * config.n_layer
        return width * (3 * p_blocks + 2 * (P - p_blocks))
    raise ValueError(system)


# --------------------------------------------------------------------------- measurement


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's memory on this rank is its local shard."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def _optimizer_tree(opt: Any) -> Iterable[Any]:
    """The optimizer and any optimizer it wraps (ZeRO and precision wrappers often do)."""
    seen: set[int] = set()
    stack = [opt]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        yield o
        for name in ("optimizer", "optim", "_optimizer", "inner_optimizer", "base_optimizer"):
            inner = getattr(o, name, None)
            if inner is not None and hasattr(inner, "param_groups"):
                stack.append(inner)


def model_state_bytes(module: torch.nn.Module, optimizers: Iterable[Any]) -> dict[str, int]:
    """Bytes of params, grads and optimizer state held by this rank, seen from outside.

    Each storage is counted once (by ``data_ptr``) under the first category that
    reaches it, so views into flat buffers are not double counted. Freed storages
    (resized to 0 bytes, as ZeRO-3/FSDP do with gathered params) count as 0.
    """
    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in seen:
            return
        seen.add(ptr)
        out[kind] += storage.nbytes()

    for p in module.parameters():
        add("params", p)
    for p in module.parameters():
        add("grads", p.grad)
    for opt in optimizers:
        for o in _optimizer_tree(opt):
            for group in o.param_groups:
                for p in group["params"]:
                    add("params", p)
                    add("grads", getattr(p, "grad", None))
            for state in o.state.values():
                for v in state.values() if isinstance(state, dict) else ():
                    add("optimizer", v)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def _load_comm_stats() -> Any:
    try:
        from lightning_zero.engine.comm.collectives import comm_stats

        return comm_stats()
    except Exception:  # not written yet, or a different API: fall back to the analytic value
        return None


class BenchCallback(L.Callback):
    """Times steps and records memory/communication on every rank; rank 0 writes the JSON line."""

    def __init__(
        self,
        system: str,
        config: GPTConfig,
        batch_size: int,
        warmup: int,
        steps: int,
        out: str,
        precision: str,
        monitor: Any = None,
        optimizer: str = "adamw",
        profile_steps: int = 0,
        accumulate: int = 1,
        host_profile_steps: int = 0,
    ) -> None:
        #: Micro-batches per optimizer step: a step's time is the sum of its micro-batches' (``step_times``).
        self.accumulate = accumulate
        self.monitor = monitor  # a ZeroMonitor in the same run (--monitor): its last logged figures are reported
        self.system = system
        self.precision = precision
        self.optimizer = optimizer
        self.config = config
        self.batch_size = batch_size
        self.warmup = warmup
        self.steps = steps
        self.out = out
        self.times: list[float] = []
        self.cpu_seconds = 0.0  # process CPU time over the measured micro-batches
        self.state: dict[str, int] = {}
        self.comm = _load_comm_stats() if system.startswith("zero") else None
        self.comm_snapshot: dict[str, Any] | None = None
        self._t0 = 0.0
        self._batch_idx = -1
        self._excluded = 0.0
        self._saved_ctx = None
        self.saved_activation_bytes = None
        #: Steps after the measured ones that run under the profiler for the phase breakdown (phases.py): the
        #: profiler slows a step, so the timed steps never run under it.
        self.profile_steps = profile_steps
        self.windows = PhaseWindows()
        self.phases: dict[str, float] = {}
        #: Steps after those that run under cProfile (host_profile.py): where the training thread's time goes.
        self.host_profile_steps = host_profile_steps
        self.host = HostProfile()
        self.host_summary: dict[str, Any] | None = None

    @property
    def _optimizer_steps(self) -> int:
        """The measured optimizer steps (``steps`` counts micro-batches)."""
        return self.steps // self.accumulate

    def step_times(self) -> list[float]:
        """One time per optimizer step: the measured micro-batches summed by accumulation window."""
        k = self.accumulate
        return [sum(self.times[i : i + k]) for i in range(0, len(self.times) - k + 1, k)]

    def _profiled(self, batch_idx: int) -> bool:
        start = self.warmup + self.steps
        return start <= batch_idx < start + self.profile_steps

    def _host_profiled(self, batch_idx: int) -> bool:
        start = self.warmup + self.steps + self.profile_steps
        return start <= batch_idx < start + self.host_profile_steps

    def _measured(self, batch_idx: int) -> bool:
        return self.warmup <= batch_idx < self.warmup + self.steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup and self.comm is not None:
            self.comm.reset()
        if batch_idx == self.warmup:  # what autograd keeps for backward, on one (unmeasured-time) step
            self._saved_ctx = saved_tensor_bytes(exclude=list(pl_module.parameters()))
            self._saved = self._saved_ctx.__enter__()
        self._batch_idx = batch_idx
        if batch_idx == self.warmup + self.steps and self.profile_steps:
            self.windows.start()
        if self._profiled(batch_idx):
            self.windows.enter("forward")
        self._excluded = self._cpu_excluded = 0.0
        if self._host_profiled(batch_idx):
            self.host.enter()
        self._t0 = time.perf_counter()
        self._cpu0 = time.process_time()

    def setup(self, trainer, pl_module, stage) -> None:
        # Before the strategy sets up: everything alive now that is not a parameter (data, buffers,
        # caches) is not model state, and nothing of the strategy's exists yet.
        params = sum(_local(p).untyped_storage().nbytes() for p in pl_module.parameters() if not p.is_meta)
        self._baseline = live_tensor_bytes() - params
        # After backward through the strategy's own `post_backward`, not the `on_after_backward` hook: a callback
        # with code there may change the gradients, so ZeroStrategy would keep the offloaded step from starting
        # during backward (`strategy/callback_support.py`) and the benchmark would measure another schedule.
        post_backward = trainer.strategy.post_backward

        def post_backward_then_measure(closure_loss):
            post_backward(closure_loss)
            self._after_backward(trainer, pl_module)

        trainer.strategy.post_backward = post_backward_then_measure

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._profiled(self._batch_idx):
            self.windows.enter("backward")
        if self._saved_ctx is not None:
            self.saved_activation_bytes = self._saved["bytes"]
            self._saved_ctx.__exit__(None, None, None)
            self._saved_ctx = None

    def _after_backward(self, trainer, pl_module) -> None:
        if self._profiled(self._batch_idx):
            self.windows.enter("step")
        # Count once, on the last measured step: by then optimizer state exists.
        if self._batch_idx == self.warmup + self.steps - 1:
            t, cpu = time.perf_counter(), time.process_time()
            engine = getattr(trainer.strategy, "engine", None)
            for optimizer in trainer.optimizers if engine is not None else ():
                engine.optimizer_shards(getattr(optimizer, "_optimizer", optimizer)).settle()  # parts in flight
            self.state = model_state_bytes(pl_module, trainer.optimizers)
            self.state["live_total"] = live_tensor_bytes() - self._baseline
            if engine is not None:  # ZeroStrategy: split by where the engine put each tensor
                placed = placed_state_bytes(
                    pl_module, [getattr(o, "_optimizer", o) for o in trainer.optimizers], engine
                )
                self.state["device"], self.state["host"] = placed["device"], placed["host"]
            self._excluded += time.perf_counter() - t  # bookkeeping is not part of the step
            self._cpu_excluded += time.process_time() - cpu

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dt = time.perf_counter() - self._t0 - self._excluded
        if self._host_profiled(batch_idx):
            self.host.leave()
            if batch_idx == self.warmup + self.steps + self.profile_steps + self.host_profile_steps - 1:
                self.host_summary = self.host.summary(self.host_profile_steps // self.accumulate)
        if self._measured(batch_idx):
            self.times.append(dt)
            self.cpu_seconds += time.process_time() - self._cpu0 - self._cpu_excluded
        if self._profiled(batch_idx):
            self.windows.leave()
            if batch_idx == self.warmup + self.steps + self.profile_steps - 1:
                self.phases = self.windows.stop(self.profile_steps // self.accumulate)
        if batch_idx == self.warmup + self.steps - 1 and self.comm is not None:
            self.comm_snapshot = dict(self.comm.snapshot())

    def on_train_end(self, trainer, pl_module) -> None:
        self.times = self.step_times()
        rank_result = {
            "rank": trainer.global_rank,
            "step_ms_median": 1e3 * statistics.median(self.times) if self.times else None,
            "step_ms_min": 1e3 * min(self.times) if self.times else None,
            "step_ms_max": 1e3 * max(self.times) if self.times else None,
            # CPU time of every thread of this process (gloo's included) over the measured steps: the work a step
            # costs, whatever else the machine ran meanwhile (a shared machine's other tenants, steal time).
            "cpu_ms_per_step": 1e3 * self.cpu_seconds / self._optimizer_steps,
            "state_bytes": self.state,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,  # KiB on Linux
            "comm_bytes_per_step": (self.comm_snapshot["bytes"] / self._optimizer_steps)
            if self.comm_snapshot
            else None,
            "comm_elements_per_step": (self.comm_snapshot["elements"] / self._optimizer_steps)
            if self.comm_snapshot
            else None,
            "comm_inter_node_bytes_per_step": (self.comm_snapshot["bytes_inter_node"] / self._optimizer_steps)
            if self.comm_snapshot
            else None,
            "torch_threads": torch.get_num_threads(),
            # parameters this rank holds (one pipeline stage's, under pipelining)
            "held_params": sum(p.numel() for p in pl_module.parameters() if not p.is_meta),
            "saved_activation_bytes": self.saved_activation_bytes,
            "monitor": dict(self.monitor.last) if self.monitor is not None else None,
            # [Note: speculative clipping]: steps whose parts ran before the clip was known, and those it undid.
            "speculated_steps": getattr(trainer.precision_plugin, "speculated_steps", None),
            "clips_fired": getattr(trainer.precision_plugin, "clips_fired", None),
            "phases_ms": self.phases,
            "host_profile": self.host_summary,
        }
        if dist.is_available() and dist.is_initialized():
            ranks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, rank_result)
        else:
            ranks = [rank_result]
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.summarise(ranks, trainer.world_size)) + "\n")

    def _analytic_inter(self, P: int, N: int) -> float:
        """Inter-node bytes per rank of the baselines (not counted by collectives.py): all of it when groups span
        nodes; for HSDP only the shard all-reduce."""
        if _NODES == 1:
            return 0.0
        if self.system == "fsdp2_hsdp":
            return replica_all_reduce_bytes(P, self.precision, N // _NODES)
        return analytic_comm_bytes(self.system, self.config, self.precision)

    def summarise(self, ranks: list[dict[str, Any]], N: int) -> dict[str, Any]:
        P = count_parameters(self.config)
        step_ms = max(r["step_ms_median"] for r in ranks if r["step_ms_median"] is not None)  # slowest rank
        state = max(r["state_bytes"].get("live_total", 0) for r in ranks)  # worst rank
        formula = formula_bytes(self.system, P, N, self.precision)
        formula_device, formula_host = formula_split(self.system, P, N, self.precision)
        stages = pipeline_stages(self.system)
        if stages > 1:  # the busiest stage's parameters, sharded over the N / stages replicas
            choice = CHOICES_BY_NAME[_CHOICE_OF[self.system.partition("+")[0]]]
            formula_device, formula_host = max(
                (model_state_split(choice, r["held_params"], N // stages, self.precision) for r in ranks), key=sum
            )
            formula = formula_device + formula_host
        measured_comm = [r["comm_bytes_per_step"] for r in ranks if r["comm_bytes_per_step"] is not None]
        measured_inter = [
            r["comm_inter_node_bytes_per_step"] for r in ranks if r["comm_inter_node_bytes_per_step"] is not None
        ]
        analytic_comm = analytic_comm_bytes(self.system, self.config, self.precision, shard_size=N // _NODES)
        return {
            "system": self.system,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "world_size": N,
            "params": P,
            "config": asdict(self.config),
            "batch_per_rank": self.batch_size * self.accumulate,  # per optimizer step
            "accumulate": self.accumulate,
            "warmup_steps": self.warmup,
            "measured_steps": self.steps,
            "step_ms": step_ms,
            "cpu_ms_per_step": sum(r["cpu_ms_per_step"] for r in ranks),  # every rank's
            "tokens_per_s": self.batch_size * self.config.block_size * N / (step_ms / 1e3),
            "state_bytes": state,
            "formula_bytes": formula,
            "delta_pct": 100.0 * (state - formula) / formula,
            # Device and host parts (ZeroStrategy's own accounting; others hold everything on the device).
            "device_bytes": max(r["state_bytes"].get("device", r["state_bytes"].get("live_total", 0)) for r in ranks),
            "host_bytes": max(r["state_bytes"].get("host", 0) for r in ranks),
            "formula_device_bytes": formula_device,
            "formula_host_bytes": formula_host,
            "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
            "saved_activation_mb": max((r["saved_activation_bytes"] or 0) for r in ranks) / 1e6,
            "comm_bytes_per_step": max(measured_comm) if measured_comm else analytic_comm,
            "comm_source": "measured" if measured_comm else "analytic",
            "comm_inter_node_bytes_per_step": max(measured_inter) if measured_inter else self._analytic_inter(P, N),
            "nodes": _NODES,
            "comm_analytic_bytes_per_step": analytic_comm,
            "monitor": ranks[0]["monitor"],
            "speculated_steps": ranks[0]["speculated_steps"],
            "clips_fired": ranks[0]["clips_fired"],
            "per_rank": ranks,
            "torch": torch.__version__,
            "lightning": L.__version__,
        }


# --------------------------------------------------------------------------- one system (child)


def run_system(args: argparse.Namespace) -> None:
    # 2 ranks on 2 cores: more than one intra-op thread per rank oversubscribes the CPU.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // (args.devices * args.nodes)))
    L.seed_everything(0, verbose=False)
    model_kw = {**(QUICK_MODEL if args.quick else FULL_MODEL), **json.loads(args.model or "{}")}
    config = GPTConfig(**model_kw, dropout=0.0, bias=True)
    total_steps = args.warmup + args.steps + args.profile_steps + args.host_profile_steps
    stages = pipeline_stages(args.system)
    data = RandomTokenDataModule(
        vocab_size=config.vocab_size,
        block_size=config.block_size,
        batch_size=args.batch_size * stages,  # the same global batch: the ranks of a pipeline share a batch
        num_samples=2 * total_steps * args.batch_size * args.devices * args.nodes,
    )
    global _NODES
    _NODES = args.nodes
    module_cls = FSDP2GPTModule if args.system.startswith("fsdp2") else GPTLightningModule
    if args.optimizer == "muon":
        if args.system.startswith("fsdp2"):
            sys.exit("--optimizer muon: FSDP2 has no whole-matrix step (Muon would orthogonalise each rank's rows)")
        module_cls = MuonGPTModule
    model = module_cls(**model_kw, dropout=0.0, bias=True, build_in_configure_model=True)
    if args.system == "fsdp2_hsdp":
        model.hsdp_shard_size = args.devices  # a node's ranks
    if args.system == "fsdp2" and args.precision == "bf16-mixed":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        model.mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    monitor = ZeroMonitor(log_every_n_steps=1, prog_bar=False) if args.monitor else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=build_strategy(args.system, args.devices * args.nodes),
        precision=args.precision,
        # Manual optimization counts each optimizer's step: Muon + AdamW make two per batch.
        max_steps=total_steps // args.accumulate * (2 if args.optimizer == "muon" else 1),
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.gradient_clip_val,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,  # the GPT module has a validation_step; the benchmark data has no val set
        # The bench callback first: its step timer stops before the monitor gathers its figures.
        callbacks=[
            BenchCallback(
                args.system,
                config,
                args.batch_size,
                args.warmup,
                args.steps,
                args.out,
                args.precision,
                monitor,
                args.optimizer,
                args.profile_steps,
                args.accumulate,
                args.host_profile_steps,
            ),
            *([monitor] if monitor is not None else []),
        ],
    )
    trainer.fit(model, datamodule=data)


# --------------------------------------------------------------------------- driver (parent)


def run_child(system: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any] | None:
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / f"{system}.json"
    log = workdir / f"{system}.log"
    cmd = (
        [
            sys.executable,
            os.path.abspath(__file__),
            "--system",
            system,
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--devices",
            str(args.devices),
            "--batch-size",
            str(args.batch_size),
            "--precision",
            args.precision,
            "--nodes",
            str(args.nodes),
            "--optimizer",
            args.optimizer,
            "--profile-steps",
            str(args.profile_steps),
            "--accumulate",
            str(args.accumulate),
            "--host-profile-steps",
            str(args.host_profile_steps),
        ]
        + (["--model", args.model] if args.model else [])
        + (["--gradient-clip-val", str(args.gradient_clip_val)] if args.gradient_clip_val else [])
        + (["--quick"] if args.quick else [])
        + (["--monitor"] if args.monitor else [])
    )
    print(f"== {system}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    port = _free_port()
    with open(log, "w") as logf:
        # New session = new process group, so a hung run (all its ranks) can be killed as one. One launcher per
        # simulated node, as on a cluster (NODE_RANK, one master address and port).
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs = [
            subprocess.Popen(
                cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env={**env, "NODE_RANK": str(node)}
            )
            for node in range(args.nodes)
        ]
        deadline = time.monotonic() + args.timeout
        try:
            codes = [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in procs]
            rc = next((code for code in codes if code), 0)
        except subprocess.TimeoutExpired:
            rc = f"timeout after {args.timeout}s"
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    elapsed = time.perf_counter() - t0
    if rc == 0 and out.exists():
        print(f"   {system}: ok in {elapsed:.0f}s", file=sys.stderr, flush=True)
        return json.loads(out.read_text())
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
    print(
        f"!! {system} FAILED (rc={rc}, {elapsed:.0f}s); last lines of its log:\n{tail}\n", file=sys.stderr, flush=True
    )
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One result per system: the median step time over rounds (the mean of the middle two for an even
    count); memory and communication from the first round (they do not vary)."""
    result = dict(rounds[0])
    result["rounds_step_ms"] = [r["step_ms"] for r in rounds]
    result["step_ms"] = statistics.median(result["rounds_step_ms"])
    result["rounds_cpu_ms"] = [r["cpu_ms_per_step"] for r in rounds]
    result["cpu_ms_per_step"] = statistics.median(result["rounds_cpu_ms"])
    # Per rank and category: the median over the rounds that profiled.
    per_round = [[rank.get("phases_ms") or {} for rank in r["per_rank"]] for r in rounds]
    result["phases_ms"] = [
        {key: statistics.median(ranks[i][key] for ranks in per_round if ranks[i]) for key in per_round[0][i]}
        for i in range(len(per_round[0]))
    ]
    config = result["config"]
    result["tokens_per_s"] = (
        result["batch_per_rank"] * config["block_size"] * result["world_size"] / (result["step_ms"] / 1e3)
    )
    return result


def _round_ratios(result: dict[str, Any], ddp: dict[str, Any] | None, key: str = "rounds_step_ms") -> str:
    """The median of the per-round ratios to ddp, then each round's: rounds are interleaved, so a round's ratio
    compares runs minutes apart and cancels this shared machine's slow drifts (up to 15% between rounds)."""
    if ddp is None or len(result[key]) != len(ddp[key]):
        return "-"
    ratios = [mine / theirs for mine, theirs in zip(result[key], ddp[key])]
    return f"{statistics.median(ratios):.2f} (" + " ".join(f"{x:.2f}" for x in ratios) + ")"


def print_table(results: list[dict[str, Any]], failed: list[str]) -> None:
    ddp = next((r for r in results if r["system"] == "ddp"), None)
    cols = [
        "system",
        "step_ms",
        "tokens/s",
        "ratio_vs_ddp",
        "round_ratios",
        "cpu_ms/step",
        "cpu_round_ratios",
        "state_MB",
        "formula_MB",
        "delta%",
        "device_MB (formula)",
        "host_MB (formula)",
        "peak_RSS_MB",
        "saved_act_MB",
        "comm_MB/step",
        "intra_node_MB/step",
        "inter_node_MB/step",
    ]
    rows = []
    for r in results:
        comm = f"{r['comm_bytes_per_step'] / 1e6:.1f}" + (" (analytic)" if r["comm_source"] == "analytic" else "")
        rows.append(
            [
                r["system"],
                f"{r['step_ms']:.1f}",
                f"{r['tokens_per_s']:.0f}",
                f"{r['step_ms'] / ddp['step_ms']:.2f}" if ddp else "-",
                _round_ratios(r, ddp),
                f"{r['cpu_ms_per_step']:.0f}",
                _round_ratios(r, ddp, "rounds_cpu_ms"),
                f"{r['state_bytes'] / 1e6:.2f}",
                f"{r['formula_bytes'] / 1e6:.2f}",
                f"{r['delta_pct']:+.1f}",
                f"{r['device_bytes'] / 1e6:.2f} ({r['formula_device_bytes'] / 1e6:.2f})",
                f"{r['host_bytes'] / 1e6:.2f} ({r['formula_host_bytes'] / 1e6:.2f})",
                f"{r['peak_rss_mb']:.0f}",
                f"{r.get('saved_activation_mb', 0):.0f}",
                comm,
                f"{(r['comm_bytes_per_step'] - r.get('comm_inter_node_bytes_per_step', 0)) / 1e6:.1f}",
                f"{r.get('comm_inter_node_bytes_per_step', 0) / 1e6:.1f}"
                + (" (analytic)" if r["comm_source"] == "analytic" and r.get("nodes", 1) > 1 else ""),
            ]
        )
    rows += [[name, "FAILED"] + [""] * (len(cols) - 2) for name in failed]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    if results:
        r = results[0]
        print(
            f"\n{r['precision']}, {r.get('optimizer', 'adamw')}, P = {r['params']:,} params, {r['world_size']} ranks, batch {r['batch_per_rank']}/rank x "
            f"{r['config']['block_size']} tokens, median of {r['measured_steps']} steps after {r['warmup_steps']} "
            f"warmup ({len(r['rounds_step_ms'])} interleaved round(s), median; round_ratios: the median of each round's "
            f"ratio to ddp, then each round's); step_ms/state/RSS are the worst "
            f"rank; cpu_ms/step: CPU time of every thread of every rank per step, and its ratios likewise; MB = 1e6 bytes."
        )


def print_phases(results: list[dict[str, Any]]) -> None:
    """The phase breakdown (phases.py), one row per system and rank."""
    from phases import CATEGORIES

    rows = [
        (r["system"], rank, phases) for r in results for rank, phases in enumerate(r.get("phases_ms") or []) if phases
    ]
    if not rows:
        return
    cols = ["system", "rank", *CATEGORIES, "total", "comm_threads"]
    print(
        "\nPhase breakdown, ms per step on the training thread (profiled steps; comm_threads: other threads in profiled operators, see phases.py)"
    )
    print("  ".join(f"{c:>12}" for c in cols))
    for system, rank, phases in rows:
        print("  ".join([f"{system:>12}", f"{rank:>12}", *(f"{phases[c]:>12.1f}" for c in cols[2:])]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ddp vs FSDP2 vs ZeRO-1/2/3 on one GPT (CPU)")
    p.add_argument(
        "--systems", default=",".join(ALL_SYSTEMS), help="comma-separated subset of " + ",".join(ALL_SYSTEMS)
    )
    p.add_argument("--steps", type=int, default=15, help="measured steps")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    p.add_argument("--devices", type=int, default=2, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes (one launcher each, on this machine)")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--quick", action="store_true", help="tiny model: a smoke test, not a benchmark")
    p.add_argument(
        "--monitor",
        action="store_true",
        help="also run lightning_zero.observability.ZeroMonitor every step and report its figures (its "
        "measurement runs inside the timed step: compare step times without it)",
    )
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed"), help="Trainer precision")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "muon"),
        help="adamw (the demo's), or torch.optim.Muon on the blocks' matrices + AdamW on the rest",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="accumulate_grad_batches: step_ms is then one optimizer step (that many micro-batches)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=3,
        help="steps after the measured ones run under torch.profiler for the phase breakdown (0: none)",
    )
    p.add_argument(
        "--host-profile-steps",
        type=int,
        default=0,
        help="steps after those that run under cProfile: the training thread's time by package "
        "(host_profile.py; 0: none)",
    )
    p.add_argument("--model", help="GPT settings over the default model's, as JSON: '{\"n_layer\": 24}'")
    p.add_argument(
        "--gradient-clip-val",
        type=float,
        default=None,
        help="Trainer(gradient_clip_val=...); with offload the host steps parts speculatively and the result counts "
        "the steps the clip fired in",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per system before it is killed")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems this many times, interleaved (A B C, A B C); step time is the median over rounds",
    )
    p.add_argument("--system", help=argparse.SUPPRESS)  # internal: run one system (child mode)
    p.add_argument("--out", help=argparse.SUPPRESS)  # internal: where rank 0 writes its JSON line
    args = p.parse_args()
    if (
        args.steps < 1
        or args.warmup < 0
        or args.rounds < 1
        or min(args.profile_steps, args.host_profile_steps) < 0
        or args.accumulate < 1
    ):
        p.error("--steps, --rounds and --accumulate must be >= 1, --warmup and --profile-steps >= 0")
    # Measured and profiled windows start at an optimizer step: counts are in micro-batches, whole windows. The
    # driver converts them once; a child (``--system``) receives micro-batches already.
    if not args.system:
        args.warmup, args.steps, args.profile_steps, args.host_profile_steps = (
            args.accumulate * v for v in (args.warmup, args.steps, args.profile_steps, args.host_profile_steps)
        )
    return args


def main() -> None:
    args = parse_args()
    if args.system:
        run_system(args)
        return
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [
        s
        for s in systems
        if s not in (*ALL_SYSTEMS, *BASELINES)
        and not (s.partition("+")[0] in ALL_SYSTEMS[2:] and s.partition("+")[2] in VARIANTS)
    ]
    if unknown:
        sys.exit(f"unknown system(s): {', '.join(unknown)}; choose from {', '.join(ALL_SYSTEMS)}")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="bench_core_") as tmp:
        # Interleaved rounds: a slow spell of a shared machine then hits every system alike.
        for round_index in range(args.rounds):
            for system in systems:
                result = run_child(system, args, Path(tmp) / f"round{round_index}")
                if result is not None:
                    runs[system].append(result)
    results = [combine_rounds(runs[s]) for s in systems if runs[s]]
    failed = [s for s in systems if not runs[s]]
    for r in results:
        print(json.dumps(r))
    print()
    print_table(results, failed)
    print_phases(results)


if __name__ == "__main__":
    main()
