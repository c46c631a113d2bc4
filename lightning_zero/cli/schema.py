"""Which keys a LightningCLI config may hold, read from the signatures LightningCLI itself reads.

A typo must fail before any process starts and name the nearest valid key. jsonargparse rejects unknown
keys too, but without a suggestion and, for a key under a ``class_path``, buried in a union-type report;
so the composed config is checked here first, against the same signatures: the Trainer's, the
subcommand's, and each ``class_path``'s ``__init__`` (following ``**kwargs`` to the parent classes, as
jsonargparse does).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_zero.cli.compose import set_path
from lightning_zero.cli.errors import CLIConfigError, UnknownKeyError
from lightning_zero.config.choices import closest, nearest

#: Command-line shorthands: ``strategy.stage=2`` is ``trainer.strategy.init_args.stage=2``.
ALIASES = {"strategy": ("trainer", "strategy")}
CLASS_KEYS = frozenset({"class_path", "init_args", "dict_kwargs"})
#: Keys whose value is a class chosen by ``class_path``: a shorthand below one needs the class first.
CLASS_SLOTS = {("model",), ("data",), ("trainer", "strategy"), ("optimizer",), ("lr_scheduler",)}
_LOADER_ARGUMENTS = {"self", "model", "train_dataloaders", "val_dataloaders", "dataloaders", "datamodule"}


def import_class(class_path: str, where: str) -> Any:
    """The object a dotted ``class_path`` names; None for a bare name, which jsonargparse resolves itself."""
    if "." not in class_path:
        return None
    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CLIConfigError(f"{where}: class_path {class_path!r} cannot be imported ({err}).") from None
    if not hasattr(module, name):
        public = [n for n in dir(module) if not n.startswith("_")]
        hint = closest(name, public)
        raise CLIConfigError(f"{where}: module {module_name!r} has no {name!r} (class_path {class_path!r}).{hint}")
    return getattr(module, name)


@functools.lru_cache(maxsize=None)
def init_parameters(cls: type) -> frozenset[str] | None:
    """Keyword arguments ``cls(...)`` accepts; None when ``**kwargs`` reaches ``object`` (anything goes)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            return None
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            return None
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        names |= {p.name for p in parameters if p.kind in kinds and p.name != "self"}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return frozenset(names)
    return None


def expand_registered_name(name: str) -> dict | None:
    """``"zero3"`` as ``{class_path: ..., init_args: {stage: 3}}``, so ``strategy.stage=2`` can edit it; an unknown
    ``zero…`` name is refused with the message ``Trainer(strategy=...)`` gives (``strategy/early_checks.py``)."""
    from lightning.pytorch.strategies import (
        StrategyRegistry,
    )  # holds the zero* names: importing this package registered them

    from lightning_zero.strategy.early_checks import check_strategy_name

    if name not in StrategyRegistry:
        check_strategy_name(name, setting="trainer.strategy")
        return None
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(entry["init_params"])}


class LightningSchema:
    """The keys ``lightning-zero <subcommand>`` accepts, for :func:`~lightning_zero.cli.compose.compose`."""

    #: A Trainer given no ``logger`` makes Lightning's default one (TensorBoard, or CSV), so Hydra's ``~trainer.logger``
    #: (remove the configured logger) would bring one back; it means no logger, as a Hydra user expects.
    off_when_deleted: Mapping[tuple[str, ...], Any] = {("trainer", "logger"): False}

    def __init__(self, subcommand: str) -> None:
        self.subcommand = subcommand

    @functools.cached_property
    def top_keys(self) -> frozenset[str]:
        from lightning.pytorch import Trainer

        method = inspect.signature(getattr(Trainer, self.subcommand)).parameters
        own = {"seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler"}
        return frozenset(own | (set(method) - _LOADER_ARGUMENTS))

    @functools.cached_property
    def trainer_keys(self) -> frozenset[str]:
        from lightning.pytorch import Trainer

        keys = init_parameters(Trainer)
        if keys is None:
            raise RuntimeError("lightning_zero internal error: Trainer.__init__ takes no **kwargs")
        return keys

    def allowed(self, path: Sequence[str], node: Any, owner: Any) -> tuple[frozenset[str] | None, str]:
        """Keys allowed under ``path`` (None: any) and what to call that place in an error."""
        if not path:
            return self.top_keys, f"the `{self.subcommand}` config"
        if tuple(path) == ("trainer",):
            return self.trainer_keys, "lightning.pytorch.Trainer"
        if isinstance(node, dict) and "class_path" in node:
            return CLASS_KEYS, ".".join(path)
        if path[-1] == "init_args" and isinstance(owner, dict) and isinstance(owner.get("class_path"), str):
            cls = import_class(owner["class_path"], ".".join(path[:-1]))
            return (init_parameters(cls) if isinstance(cls, type) else None), owner["class_path"]
        return None, ".".join(path)

    def locate(self, config: dict, key: str) -> tuple[list[str], bool]:
        """The path of ``key`` in ``config``: aliases expanded and ``init_args`` inserted below a
        ``class_path``. A registered strategy name that the key reaches below is rewritten, in ``config``,
        into its class form (the same strategy), so that its arguments can be set."""
        user = key.split(".")
        head = list(ALIASES.get(user[0], (user[0],)))
        target = head + user[1:]
        offset = len(head) - 1  # target index -> user index
        path: list[str] = []
        node: Any = config
        owner: Any = None
        exists = True
        for index, segment in enumerate(target):
            if isinstance(node, str) and tuple(path) in CLASS_SLOTS and (expanded := expand_registered_name(node)):
                node = expanded
                set_path(config, path, node)
            if tuple(path) in CLASS_SLOTS and node is None and index:
                raise CLIConfigError(
                    f"{key}: `{'.'.join(path)}` is not set in the config, so there is no class to take {segment!r}; "
                    f"pick one first (e.g. a config group or `+{'.'.join(path)}.class_path=...`)."
                )
            if node is not None and not isinstance(node, (dict, list)):
                raise CLIConfigError(f"{key}: `{'.'.join(path)}` is {node!r}, not a mapping with a {segment!r} key.")
            if isinstance(node, dict) and "class_path" in node and segment not in CLASS_KEYS:
                owner, node = node, node.get("init_args") or {}
                path.append("init_args")
            allowed, place = self.allowed(path, node, owner)
            present = (isinstance(node, dict) and segment in node) or (
                isinstance(node, list) and segment.isdigit() and int(segment) < len(node)
            )
            if allowed is not None and segment not in allowed and not present:
                candidates = (
                    set(allowed) | (set(node) if isinstance(node, dict) else set()) | (set() if path else set(ALIASES))
                )
                what = "key" if place.startswith("the ") else "argument"
                suggestion = _suggest(user, index - offset, segment, candidates)
                hint = f" Did you mean {suggestion!r}?" if suggestion else ""
                raise UnknownKeyError(f"unknown key {key!r}: {place} has no {what} {segment!r}.{hint}", suggestion)
            owner = node
            path.append(segment)
            exists = exists and present
            node = (node[int(segment)] if isinstance(node, list) else node[segment]) if present else None
        return path, exists

    def check(self, config: dict) -> None:
        _check_keys(config, self.top_keys, f"the `{self.subcommand}` config", "")
        trainer = config.get("trainer")
        if trainer is not None and not isinstance(trainer, dict):
            raise CLIConfigError(f"`trainer` must be a mapping of Trainer arguments, not {trainer!r}.")
        if trainer:
            _check_keys(trainer, self.trainer_keys, "lightning.pytorch.Trainer", "trainer.")
        _check_classes(config, [])


def _suggest(user: list[str], index: int, segment: str, candidates: set[str]) -> str | None:
    """The user's key with its unknown segment replaced by the nearest valid one."""
    best = nearest(segment, candidates)
    if best is None or not 0 <= index < len(user):
        return best
    return ".".join([*user[:index], best, *user[index + 1 :]])


def _check_keys(node: dict, allowed: frozenset[str] | None, place: str, prefix: str) -> None:
    if allowed is None:
        return
    for key in node:
        if key not in allowed:
            raise CLIConfigError(
                f"unknown key {prefix + str(key)!r}: {place} has no argument {str(key)!r}.{closest(str(key), allowed)}"
            )


def _check_classes(node: Any, path: list[str]) -> None:
    """Every ``class_path`` imports and every ``init_args`` key is an argument of its class."""
    where = ".".join(path) or "the config"
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_classes(item, [*path, str(i)])
    if not isinstance(node, dict):
        return
    if "class_path" not in node:
        for key, value in node.items():
            _check_classes(value, [*path, key])
        return
    _check_keys(node, CLASS_KEYS, where, f"{where}.")
    cls = import_class(str(node["class_path"]), where)
    arguments = node.get("init_args") or {}
    if not isinstance(arguments, dict):
        raise CLIConfigError(f"{where}.init_args must be a mapping of argument names to values.")
    if isinstance(cls, type):
        _check_keys(arguments, init_parameters(cls), node["class_path"], f"{where}.init_args.")
    for key, value in arguments.items():
        _check_classes(value, [*path, "init_args", key])
