"""ZeroPrecision: the precision plugin ZeroStrategy runs with.

It owns the part of the optimizer step where precision and sharding meet: gradients are *finalized*
(averaged over ranks, see [Note: gradients are held as sums until finalized], and unscaled) before any hook,
clipping or the step sees them; under ``"16-mixed"`` an inf/NaN in any rank's shard skips the step on every
rank; clipping by norm uses the global norm over every rank's shards.

[Note: what each precision holds and computes in]
* ``"32-true"``: everything fp32.
* ``"bf16-mixed"`` / ``"16-mixed"``: the ZeRO mixed-precision memory model (see ``engine/mixed_precision.py``):
  parameters held in bf16/fp16 for compute, fp32 master shards updated by the optimizer. Forward runs under
  ``torch.autocast`` as in Lightning's own mixed modes, so the operations autocast keeps in fp32 (losses such
  as ``cross_entropy``/``mse_loss``, and on CUDA softmax, ``layer_norm`` and the other reductions in its fp32
  list) stay fp32. Layers whose own parameters include a matrix hold them in the 2-byte dtype; layers with
  vector parameters only (every normalization layer, learned scales) hold them in fp32, so they run on fp32
  and 2-byte inputs alike, as under Lightning's DDP (see [Note: which parameters may be held in the compute
  dtype] in ``engine/mixed_precision.py``); frozen parameters are left as they are. Gradients are summed over ranks in
  ``reduce_dtype``: fp32 by default for ``16-mixed`` (fp16's range and 11-bit mantissa make a sum of loss-scaled
  gradients the likeliest place to overflow or lose bits), bf16 by default for ``bf16-mixed`` (it has fp32's
  range, halves the gradient traffic, and stages 1-2 hold the reduced gradient in bf16 anyway; pass
  ``reduce_dtype="fp32"`` for very many ranks, where the ring's per-hop bf16 roundings add up).
* ``"bf16-true"``: the whole module, its inputs and the optimizer state in bf16, as Lightning's ``bf16-true``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.core.optimizer import do_nothing_closure
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero.config.choices import ZeroConfigError, check_choice
from lightning_zero.engine import device_groups
from lightning_zero.engine.api import ShardingEngine
from lightning_zero.engine.comm import collectives
from lightning_zero.engine.mixed_precision import FP32_MODULES, PrecisionPolicy, to_dtype_but_declared_fp32
from lightning_zero.precision.loss_scaler import DynamicLossScaler, LossScaleConfig, LossScaleConfigError
from lightning_zero.torch_versions.tensors import amp_unscale_

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": torch.bfloat16}
_DEFAULT_REDUCE_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float32}
_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _unwrap(optimizer: Any) -> Optimizer:
    return getattr(optimizer, "_optimizer", optimizer)


def _as_dtype(setting: str, value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values():
        return value
    check_choice(setting, value, tuple(_DTYPE_NAMES))
    return _DTYPE_NAMES[str(value)]


class ZeroPrecision(Precision):
    """Precision plugin for :class:`~lightning_zero.ZeroStrategy`.

    ``Trainer(precision=...)`` selects it automatically; pass it as ``Trainer(plugins=[ZeroPrecision(...)])``
    to set its options (or to run ``"16-mixed"`` on CPU, which Lightning otherwise rewrites to bf16).

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.
        reduce_dtype: Mixed modes: dtype gradients are summed over ranks in (``"fp32"``, ``"bf16"``, ``"fp16"``
            or a ``torch.dtype``); default fp32 for ``16-mixed``, bf16 for ``bf16-mixed`` (see the module note).
        initial_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, dynamic_loss_scale:
            ``16-mixed`` loss scaling (see :class:`~lightning_zero.precision.loss_scaler.LossScaleConfig`).
        fp32_modules: Mixed modes: layer classes whose parameters, and those of every layer inside them, stay fp32
            whatever their shapes (layers with vector parameters only always do, and so do layers that set
            ``self.dtype = torch.float32``; add e.g. ``nn.Embedding`` to keep embedding tables fp32).
    """

    def __init__(
        self,
        precision: PrecisionName = "32-true",
        *,
        reduce_dtype: str | torch.dtype | None = None,
        initial_scale: float = LossScaleConfig.initial_scale,
        growth_factor: float = LossScaleConfig.growth_factor,
        backoff_factor: float = LossScaleConfig.backoff_factor,
        growth_interval: int = LossScaleConfig.growth_interval,
        hysteresis: int = LossScaleConfig.hysteresis,
        min_scale: float = LossScaleConfig.min_scale,
        dynamic_loss_scale: bool = True,
        fp32_modules: tuple[type[nn.Module], ...] = FP32_MODULES,
    ) -> None:
        check_choice("precision", precision, SUPPORTED_PRECISION)
        self.precision = precision
        mixed = precision in _DEFAULT_REDUCE_DTYPES
        if reduce_dtype is not None and not mixed:
            raise ZeroConfigError(
                f"`reduce_dtype` applies to the mixed modes ('bf16-mixed', '16-mixed'), not precision={precision!r}."
            )
        self.reduce_dtype = (
            _as_dtype("reduce_dtype", reduce_dtype)
            if reduce_dtype is not None
            else _DEFAULT_REDUCE_DTYPES.get(precision)
        )
        try:
            scaling = LossScaleConfig(
                initial_scale=initial_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                min_scale=min_scale,
                dynamic=dynamic_loss_scale,
            )
        except LossScaleConfigError as err:
            raise ZeroConfigError(str(err)) from None
        if precision != "16-mixed" and scaling != LossScaleConfig():
            raise ZeroConfigError(f"Loss scaling settings apply to precision='16-mixed' only, not {precision!r}.")
        self.scaler = DynamicLossScaler(scaling) if precision == "16-mixed" else None
        self.fp32_modules = tuple(fp32_modules)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(self.device_type)
        self._engine: ShardingEngine | None = None
        #: Per optimizer (by id) with finalized gradients awaiting their step: whether any rank overflowed.
        self._found_inf: dict[int, bool] = {}
        #: ``16-mixed``: the scale the last backward's loss was multiplied by (None before one), whether a step of
        #: that window has updated the scale since, and whether that update backed off.
        self._scaled_by: float | None = None
        self._scale_updated = self._scale_backed_off = False
        #: Steps whose offloaded parts ran during backward before the clip was known, and in how many of them the clip
        #: fired and undid them ([Note: speculative clipping] in ``engine/offload/speculation.py``).
        self.speculated_steps = self.clips_fired = 0

    # ------------------------------------------------------------------ dtype policy
    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype parameters are held in for forward and backward."""
        return _COMPUTE_DTYPES.get(self.precision, torch.float32)

    @property
    def is_mixed(self) -> bool:
        return self.precision in _DEFAULT_REDUCE_DTYPES

    def policy(self) -> PrecisionPolicy | None:
        """What the sharding engines need to know (None: parameters are updated in the dtype they are held in)."""
        if not self.is_mixed or self.reduce_dtype is None:  # the mixed modes have a reduce dtype
            return None
        return PrecisionPolicy(self.compute_dtype, self.reduce_dtype, fp32_modules=self.fp32_modules)

    @property
    def loss_scale(self) -> float:
        """The current ``16-mixed`` loss scale (1.0 in the other modes)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def attach(self, engine: ShardingEngine | None, device: torch.device | None = None) -> None:
        """Called by the strategy once the sharding engine exists."""
        self._engine = engine
        self._found_inf.clear()
        if device is not None:
            self.device_type = device.type
        #: Where the overflow flag and the gradient norm are reduced (the strategy's device, which the process
        #: group's backend can communicate; offloaded shards live on the host but reduce from here).
        self._device = device if device is not None else torch.device(self.device_type)

    @property
    def engine(self) -> ShardingEngine:
        if self._engine is None:
            raise RuntimeError("ZeroPrecision is used without ZeroStrategy; pass `strategy=ZeroStrategy(...)`.")
        return self._engine

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return to_dtype_but_declared_fp32(module, self.compute_dtype)
        return module  # mixed modes: the engine holds parameters in their compute dtypes

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _DtypeContextManager(self.compute_dtype) if self.precision == "bf16-true" else contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.is_mixed:
            with torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False):
                yield
        elif self.precision == "bf16-true":
            with _DtypeContextManager(self.compute_dtype):
                yield
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(
                data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=self.compute_dtype
            )
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        if self.precision == "bf16-true":
            return apply_to_collection(
                data, function=_convert_fp_tensor, dtype=torch.Tensor, dst_type=torch.get_default_dtype()
            )
        return data

    # ------------------------------------------------------------------ loss scaling
    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        # New gradients come: the last step's are final no longer. Kept until now, so that reading the step's gradients
        # after it (``lightning_zero.grad_norm`` in ``on_train_batch_end``) does not unscale them a second time.
        return super().pre_backward(self.scale_loss(tensor), module)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Before a backward, in every front end: the last step's gradients are final no longer, and ``16-mixed``
        multiplies the loss by its scale."""
        self._found_inf.clear()
        if self.scaler is None:
            return loss
        # Every optimizer of the coming step unscales by this scale, whatever an earlier optimizer's step made of it.
        self._scaled_by, self._scale_updated, self._scale_backed_off = self.scaler.scale, False, False
        return loss * self._scaled_by

    def finalize_gradients(self, optimizer: Optimizer) -> bool:
        """Average (and unscale) ``optimizer``'s gradient shards, once per step; returns whether any rank's
        shard holds an inf/NaN (one small all-reduce, ``16-mixed`` only). Collective."""
        optimizer = _unwrap(optimizer)
        key = id(optimizer)
        if key in self._found_inf:
            return self._found_inf[key]
        scale = (self._scaled_by or self.scaler.scale) if self.scaler is not None else 1.0
        self.engine.optimizer_shards(optimizer).finalize_gradients(1.0 / scale)
        found_inf = self._any_rank_found_inf(optimizer) if self.scaler is not None else False
        self._found_inf[key] = found_inf
        return found_inf

    def _any_rank_found_inf(self, optimizer: Optimizer) -> bool:
        grads = self.engine.optimizer_shards(optimizer).local_gradients()
        # Offloaded gradients are host tensors: check them where they are.
        flag = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else self._device)
        # One fused pass per device and dtype that flags non-finite values (an unscale by 1 leaves the gradients as
        # they are); partial offload holds some on the host, some on the device.
        for where, index in device_groups.by_device(grads).items():
            here = flag if where == flag.device else torch.zeros(1, dtype=torch.float32, device=where)
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for i in index:
                by_dtype.setdefault(grads[i].dtype, []).append(grads[i])
            for same in by_dtype.values():
                amp_unscale_(same, here, torch.ones(1, device=where))
            if here is not flag:
                flag += here.to(flag.device)
        collectives.all_reduce(flag, op=collectives.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def _end_step(self, optimizer: Optimizer, found_inf: bool) -> None:
        """One scale update per backward window, as ``GradScaler.update()``: a later optimizer of the same window
        updates it again only to back off, once, where it found an inf/NaN and no earlier one did."""
        if self.scaler is None or (self._scale_updated and not (found_inf and not self._scale_backed_off)):
            return
        self._scale_updated, self._scale_backed_off = True, found_inf
        before = self.scaler.scale
        after = self.scaler.update(found_inf)
        if found_inf:
            rank_zero_info(
                f"ZeroPrecision: inf/NaN in the gradients (loss scale {before:g}); the optimizer step was skipped on "
                f"every rank and the loss scale is now {after:g} ({self.scaler.skipped_steps} skipped so far)."
            )

    def step_skipped(self, optimizer: Optimizer) -> None:
        """A loop drops the gradients of a step it does not take (``zero_grad`` after a non-finite norm): where
        ``16-mixed`` found the overflow, the scale backs off as the skipped step would have backed it off."""
        if self._found_inf.get(id(_unwrap(optimizer))):
            self._end_step(_unwrap(optimizer), found_inf=True)

    # ------------------------------------------------------------------ step
    @override
    def optimizer_step(  # type: ignore[override]  # Lightning's own Precision narrows fabric's signature alike
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        optimizer = _unwrap(optimizer)
        closure_result = closure()
        # A closure's None is `training_step` returning None, a skipped backward; but ``optimizer.step()`` called
        # without one (an `optimizer_step` override that ran `optimizer_closure()` itself) hands Lightning's
        # `do_nothing_closure` here, whose None says nothing about the backward that already ran.
        skipped_backward = model.automatic_optimization and closure_result is None and closure is not do_nothing_closure
        if not skipped_backward:
            self.finalize_gradients(optimizer)  # before the hooks and clipping read the gradients
        self._after_closure(model, optimizer)
        if skipped_backward:
            # `training_step` returned None: Lightning skips the step; drop what was accumulated.
            self.engine.optimizer_shards(optimizer).discard_gradients()
            self._found_inf.pop(id(optimizer), None)
            return None
        return self.step_shards(optimizer, **kwargs)

    def step_shards(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """The step after the last backward, in every front end: finalize the gradients (if clipping has not), then
        step this rank's shards, or skip the step on every rank where ``16-mixed`` found an inf/NaN. Collective."""
        optimizer = _unwrap(optimizer)
        if self.finalize_gradients(optimizer):
            self.engine.optimizer_shards(optimizer).discard_gradients()  # parameters and optimizer state stay untouched
            self._end_step(optimizer, found_inf=True)
            return None
        result = self.engine.optimizer_shards(optimizer).step(**kwargs)
        self._end_step(optimizer, found_inf=False)
        return result

    # ------------------------------------------------------------------ clipping
    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        self.clip_by_global_norm(optimizer, clip_val)

    def clip_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> torch.Tensor | None:
        """Scale the gradient shards so that the global 2-norm over every rank's shards is at most ``clip_val``;
        returns that norm before clipping (None where ``16-mixed`` skips the step anyway). Collective."""
        optimizer = _unwrap(optimizer)
        if self.finalize_gradients(optimizer):
            return None  # the step is skipped on every rank anyway
        shards = self.engine.optimizer_shards(optimizer)
        speculated = shards.speculated_norms()
        grads = shards.local_gradients(for_change=speculated is None)
        total = global_grad_norm(grads, device=self._device, group=self.engine.norm_group, known=speculated)
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        if speculated is not None:  # parts were stepped during backward: see [Note: speculative clipping]
            self.speculated_steps += 1
            if bool(coef == 1.0):
                return total  # a coefficient of 1 changes no bit: the parts stand (a NaN norm scales them all)
            self.clips_fired += 1
            shards.undo_speculation()
        device_groups.scale_(grads, coef)  # partial offload: host and device gradients
        return total

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        optimizer = _unwrap(optimizer)
        if self.finalize_gradients(optimizer):
            return
        for grad in self.engine.optimizer_shards(optimizer).local_gradients(for_change=True):
            grad.clamp_(-clip_val, clip_val)

    # ------------------------------------------------------------------ checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """The loss scale and its counters (``16-mixed``); Lightning stores it under ``"ZeroPrecision"``."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


#: The plugins ``Trainer(precision=...)`` and ``Fabric(precision=...)`` make for a strategy that names none of its own.
_GENERIC_PLUGINS = (
    Precision,
    MixedPrecision,
    HalfPrecision,
    fabric_precision.Precision,
    fabric_precision.MixedPrecision,
    fabric_precision.HalfPrecision,
)


def as_zero_precision(plugin: FabricPrecision | None) -> ZeroPrecision | None:
    """Lightning hands a strategy the generic plugin for ``Trainer(precision=...)`` or ``Fabric(precision=...)``;
    convert it (keeping a ``GradScaler``'s settings), or say which precisions are supported."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin
    name = str(getattr(plugin, "precision", "32-true"))
    name = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}.get(name, name)
    if type(plugin) not in _GENERIC_PLUGINS or name not in SUPPORTED_PRECISION:
        raise ZeroConfigError(
            f"ZeroStrategy does not support precision {name!r} ({type(plugin).__name__}); choose one of "
            f"{SUPPORTED_PRECISION} via `precision=...` of the Trainer or Fabric, or `plugins=[ZeroPrecision(...)]`."
        )
    scaler = getattr(plugin, "scaler", None)
    precision = cast(PrecisionName, name)  # checked against SUPPORTED_PRECISION just above
    if name == "16-mixed" and scaler is not None:
        return ZeroPrecision(
            precision,
            initial_scale=float(scaler._init_scale),
            growth_factor=float(scaler._growth_factor),
            backoff_factor=float(scaler._backoff_factor),
            growth_interval=int(scaler._growth_interval),
        )
    return ZeroPrecision(precision)


def global_grad_norm(
    local_grads: list[torch.Tensor],
    device: torch.device,
    group=None,
    known: Mapping[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The 2-norm of the full gradient, from the non-overlapping shards of the ranks of ``group`` (one scalar
    all-reduce); ``known``: ``id(gradient)`` -> its 2-norm, taken already by the kernel this takes the others with."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    if local_grads:
        floats = [g if g.is_complex() else g.float() for g in local_grads]  # |g| if complex
        squares = squares + device_groups.norms(floats, 2.0, device, known=known).pow(2).sum()
    collectives.all_reduce(squares, group=group)
    return squares.sqrt().float()
