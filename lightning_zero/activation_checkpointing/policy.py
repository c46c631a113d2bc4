"""Activation checkpointing: chosen modules keep only their inputs in forward and recompute in backward.

Applied as torch's composable ``checkpoint`` is (forward hooks, no wrapper module: ``checkpointed_forward.py``),
before sharding, so parameter names, ``state_dict`` keys and logs are unchanged, and FSDP2 re-gathers stage-3
parameters for the recomputation like for any backward, once per backward that needs them (a gradient penalty's
too). Random state is saved and restored around the recomputation, so
dropout masks (and so results) are the same as without checkpointing.

A policy is one of: a module class, several classes (or ``"package.module.Class"`` strings, as YAML gives
them), a predicate ``module -> bool``, or a dict ``{"classes": [...], "every": k}`` that checkpoints every
k-th matching module (a memory/speed trade-off). DeepSpeed's ``activation_checkpointing`` keys are accepted
in the dict where they have a meaning here: ``cpu_checkpointing: true`` keeps the checkpointed inputs in host
memory (``offload_activations``, ``offload.py``); ``partition_activations`` must be false (DeepSpeed splits the
checkpointed inputs across tensor-parallel ranks, which there are none of here), ``contiguous_memory_optimization``,
``synchronize_checkpoint_boundary`` and ``profile`` are CUDA-allocator and timing switches with no
effect here and are ignored with a warning; ``number_checkpoints`` is refused (use ``every``).

[Note: caches under activation checkpointing]
A Hugging Face model whose ``config.use_cache`` is true (most encoder-decoders' default) writes its key/value
cache during forward. The recomputation in backward then runs with a cache that already holds the step's
entries, saves a different set of tensors, and torch raises ``CheckpointError: A different number of tensors
was saved``. Hugging Face's own ``gradient_checkpointing_enable()`` avoids this by training without the cache;
:func:`caches_off_for_training` does the same for the models that hold a checkpointed module, for the length of
a ``fit``. Encoder-decoders keep copies of the config in their stacks (T5's decoder), so every module's config
is visited, not only the top one's.
"""

from __future__ import annotations

import dataclasses
import importlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_zero.activation_checkpointing.checkpointed_forward import checkpoint_forward
from lightning_zero.activation_checkpointing.offload import ActivationOffload
from lightning_zero.hook_bypasses import bypassing_hooks

_IGNORED_DEEPSPEED_KEYS = ("contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile")
_OFFLOAD_KEY = "cpu_checkpointing"
_PARTITION_KEY = "partition_activations"

#: The host tier of each model whose checkpointed inputs are offloaded (see :func:`activation_offload`).
_OFFLOADS: weakref.WeakKeyDictionary[nn.Module, ActivationOffload] = weakref.WeakKeyDictionary()


class ActivationCheckpointingError(ValueError):
    """The ``activation_checkpointing`` setting cannot be understood; the message says what is allowed."""


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    predicate: Callable[[nn.Module], bool]
    every: int = 1
    description: str = ""
    offload: bool = False
    """The checkpointed inputs are kept in host memory ([Note: offloaded checkpoint inputs])."""

    def select(self, root: nn.Module) -> list[tuple[str, nn.Module]]:
        """Every ``every``-th matching module in pre-order, skipping modules inside one already chosen."""
        matches: list[tuple[str, nn.Module]] = []
        chosen: set[str] = set()
        for name, module in root.named_modules():
            if module is root or not self.predicate(module):
                continue
            if any(name.startswith(prefix + ".") for prefix in chosen):
                continue
            matches.append((name, module))
            chosen.add(name)
        return matches[:: self.every]


def _import_class(path: str) -> type[nn.Module]:
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name) if module_name else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ActivationCheckpointingError(
            f"activation_checkpointing: {path!r} is not an importable nn.Module class; give its full path, "
            "e.g. 'lightning_zero.demo.gpt.Block'."
        )
    return cls


def _classes(items: Iterable[Any]) -> tuple[type[nn.Module], ...]:
    out: list[type[nn.Module]] = []
    for item in items:
        if isinstance(item, str):
            out.append(_import_class(item))
        elif isinstance(item, type) and issubclass(item, nn.Module):
            out.append(item)
        else:
            raise ActivationCheckpointingError(
                f"activation_checkpointing: {item!r} is neither an nn.Module class nor a 'package.Class' string."
            )
    if not out:
        raise ActivationCheckpointingError("activation_checkpointing: the list of classes is empty.")
    return tuple(out)


def _from_classes(classes: tuple[type[nn.Module], ...], every: int = 1) -> CheckpointPolicy:
    names = ", ".join(c.__name__ for c in classes)
    suffix = f" (every {every})" if every > 1 else ""
    return CheckpointPolicy(lambda m: isinstance(m, classes), every, f"classes [{names}]{suffix}")


def resolve_policy(spec: Any, offload: bool = False) -> CheckpointPolicy | None:
    """Turn what the user passed into a policy (``None`` when checkpointing is off); ``offload``
    (``offload_activations``) keeps the checkpointed inputs on the host, as a dict's ``cpu_checkpointing: true`` does."""
    policy = _resolve(spec)
    return _offloaded(policy) if policy is not None and offload else policy


def _offloaded(policy: CheckpointPolicy) -> CheckpointPolicy:
    if policy.offload:
        return policy
    return dataclasses.replace(policy, offload=True, description=f"{policy.description}, offloaded")


def _resolve(spec: Any) -> CheckpointPolicy | None:
    if spec is None or spec is False:
        return None
    if isinstance(spec, CheckpointPolicy):
        return spec
    if isinstance(spec, (str, type)):
        return _from_classes(_classes([spec]))
    if isinstance(spec, dict):
        return _from_dict(spec)
    if callable(spec):
        return CheckpointPolicy(spec, 1, getattr(spec, "__name__", repr(spec)))
    if isinstance(spec, Iterable):
        return _from_classes(_classes(spec))
    raise ActivationCheckpointingError(
        f"activation_checkpointing={spec!r} is not supported; pass a module class, several classes, a callable "
        "`module -> bool`, or a dict {'classes': [...], 'every': k}."
    )


def _from_dict(spec: dict[str, Any]) -> CheckpointPolicy:
    allowed = {"classes", "every", _OFFLOAD_KEY, _PARTITION_KEY, *_IGNORED_DEEPSPEED_KEYS}
    unknown = sorted(set(spec) - allowed)
    if "number_checkpoints" in unknown:
        raise ActivationCheckpointingError(
            "activation_checkpointing: DeepSpeed's 'number_checkpoints' is not supported; use 'every': k to "
            "checkpoint every k-th matching module."
        )
    if unknown:
        raise ActivationCheckpointingError(
            f"activation_checkpointing: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}."
        )
    if spec.get(_PARTITION_KEY):
        raise ActivationCheckpointingError(
            f"activation_checkpointing: {_PARTITION_KEY}=True is not supported: DeepSpeed splits the checkpointed "
            "inputs across tensor-parallel ranks, and ZeroStrategy has no tensor parallelism. Set it to false; "
            f"{_OFFLOAD_KEY}: true (or ZeroStrategy(offload_activations=True)) moves them to host memory instead."
        )
    offload = spec.get(_OFFLOAD_KEY, False)
    if not isinstance(offload, bool):
        raise ActivationCheckpointingError(
            f"activation_checkpointing: {_OFFLOAD_KEY} must be true or false, got {offload!r}."
        )
    for key in _IGNORED_DEEPSPEED_KEYS:
        if key in spec:
            rank_zero_warn(f"activation_checkpointing: {key!r} has no effect with ZeroStrategy and is ignored.")
    if "classes" not in spec:
        raise ActivationCheckpointingError("activation_checkpointing: the dict form needs 'classes': [...].")
    every = spec.get("every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ActivationCheckpointingError(f"activation_checkpointing: 'every' must be an integer >= 1, got {every!r}.")
    classes = spec["classes"]
    policy = _from_classes(_classes([classes] if isinstance(classes, (str, type)) else classes), every)
    return _offloaded(policy) if offload else policy


def apply_activation_checkpointing(
    root: nn.Module, policy: CheckpointPolicy, pin_memory: bool | None = None
) -> list[str]:
    """Checkpoint the modules ``policy`` selects (once: applying again to the same module is a no-op), their
    inputs on the host if it offloads (pinned unless ``pin_memory`` is False). Returns their names; warns, naming
    the policy, when nothing matches."""
    selected = policy.select(root)
    if not selected:
        rank_zero_warn(
            f"activation_checkpointing policy {policy.description} matched no module of "
            f"{type(root).__name__}; nothing is checkpointed."
        )
    offload = None
    if policy.offload:
        offload = _OFFLOADS.setdefault(root, ActivationOffload(pin_memory))
    for _, module in selected:
        checkpoint_forward(module, offload)
    _warn_about_hooks_bypassed(root, selected)
    return [name for name, _ in selected]


def activation_offload(root: nn.Module) -> ActivationOffload | None:
    """The host tier of ``root``'s checkpointed inputs (its :class:`OffloadStatistics` say what moved), or None
    when they are not offloaded."""
    return _OFFLOADS.get(root)


def _warn_about_hooks_bypassed(root: nn.Module, selected: list[tuple[str, nn.Module]]) -> None:
    """Checkpointing acts in forward hooks, which a call of ``module.forward(...)`` or of another method skips
    (SqueezeBERT's encoder runs its layers so): say which selected modules keep their activations when run so, and
    what to select instead."""
    bypassed = bypassing_hooks(root)
    skipped = [(name, module) for name, module in selected if id(module) in bypassed]
    if not skipped:
        return
    inner = sorted(
        {
            type(child).__name__
            for _, module in skipped
            for child in module.children()
            if any(True for _ in child.parameters())
        }
    )
    rank_zero_warn(
        f"activation_checkpointing: the code holding {', '.join(repr(name) for name, _ in skipped[:3])}"
        f"{' and others' if len(skipped) > 3 else ''} runs it other than through its `__call__` "
        "(`layer.forward(...)`, or another method of it), which skips the hooks that checkpoint it: what runs so "
        f"keeps its activations. Checkpoint the layers they call instead ({', '.join(inner) or 'their children'}), "
        "or call them as `layer(...)`."
    )


def _is_hf_model(module: nn.Module) -> bool:
    """A Hugging Face model or stack: its ``config`` is a ``transformers`` class (told without importing the library)."""
    return type(getattr(module, "config", None)).__module__.startswith("transformers.")


def _within(inner: str, outer: str) -> bool:
    """Whether the module named ``inner`` is ``outer`` or inside it (names as ``named_modules`` gives them)."""
    return outer == "" or inner == outer or inner.startswith(f"{outer}.")


@dataclasses.dataclass
class CachesBack:
    """Turns ``use_cache`` back on in the configs :func:`caches_off_for_training` turned it off in (a plain object,
    not a closure: the strategy that holds it is pickled by the ``spawn`` start method)."""

    configs: list[Any]

    def __call__(self) -> None:
        for config in self.configs:
            config.use_cache = True


def caches_off_for_training(root: nn.Module, checkpointed: Iterable[str], announce: bool = True) -> CachesBack:
    """Turn ``use_cache`` off in every Hugging Face model holding one of the ``checkpointed`` modules (names in
    ``root``; see [Note: caches under activation checkpointing]), saying so unless not ``announce`` (the planner's
    traces); returns what turns it back on after training."""
    names = list(checkpointed)
    holders = {name: m for name, m in root.named_modules() if _is_hf_model(m) and any(_within(c, name) for c in names)}
    configs = {id(m.config): m.config for m in holders.values() if getattr(m.config, "use_cache", False) is True}
    if not configs:
        return CachesBack([])
    for config in configs.values():
        config.use_cache = False
    if not announce:
        return CachesBack(list(configs.values()))
    outermost = sorted(
        {
            type(m).__name__
            for name, m in holders.items()
            if not any(_within(name, other) for other in holders if other != name)
        }
    )
    rank_zero_info(
        f"activation_checkpointing: training {', '.join(outermost)} with use_cache=False, as Hugging Face's "
        "gradient_checkpointing_enable() does (a cache written in forward cannot be recomputed)."
    )
    return CachesBack(list(configs.values()))
