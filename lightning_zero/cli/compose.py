"""Hydra-style composition of LightningCLI configs: ``defaults:`` lists, config groups, ``key=value``.

Why not Hydra itself: Hydra owns the process (its run directory, logging and launchers), which collides
with Lightning's launcher re-running the command line in every rank. We need composition only, done
before LightningCLI parses and deterministic, so every rank that re-runs the same argv composes the same
config. Where the two overlap the semantics are Hydra's:

* ``defaults:`` in a YAML file lists group options (``- strategy: zero3`` reads ``<root>/strategy/zero3.yaml``)
  and other files (``- base``); ``_self_`` marks where the file's own keys merge, last by default.
* A group file lands under its group's key unless a ``# @package <key>`` header (or ``_global_``) says
  otherwise; ``override`` and ``optional`` in a defaults entry mean what they mean in Hydra.
* ``group=option`` on the command line picks a group option, ``~group`` drops it; ``a.b=c`` sets a key,
  ``+a.b=c`` adds one (an error if it exists), ``++a.b=c`` adds or overrides, ``~a.b`` deletes one.
* ``${...}`` is omegaconf interpolation, resolved after every override, as Hydra resolves lazily; a printed
  config keeps it (:func:`keep_interpolations`), as Hydra's ``--cfg job`` does.
* ``~trainer.logger`` switches logging off rather than leaving Lightning to make its default logger
  (:attr:`Schema.off_when_deleted`).

Merging is LightningCLI-aware: a node whose ``class_path`` changes is replaced, never deep-merged, so no
argument of the old class leaks into the new one. Which keys exist, and the shorthands (``model.n_layer``
for ``model.init_args.n_layer``), come from a :class:`Schema`: see :mod:`lightning_zero.cli.schema`. The
command line is split into files, overrides and LightningCLI's own arguments by
:mod:`lightning_zero.cli.command_line`.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_zero.cli.command_line import CommandLine, Override
from lightning_zero.cli.errors import CLIConfigError, UnknownKeyError
from lightning_zero.config.choices import closest

GLOBAL_PACKAGE = "_global_"
YAML_SUFFIXES = (".yaml", ".yml")
_PACKAGE_HEADER = re.compile(r"#\s*@package\s+(\S+)")
_MISSING: Any = object()  # no such key (None is a value)


# ---------------------------------------------------------------------------------------------- schema


class Schema(Protocol):
    """What the composition needs to know about the keys LightningCLI accepts."""

    def locate(self, config: dict, key: str) -> tuple[list[str], bool]:
        """The path ``key`` stands for in ``config`` (shorthands expanded) and whether it exists there;
        raises :class:`CLIConfigError` for a key that cannot exist, with the nearest valid one."""

    def check(self, config: dict) -> None:
        """Raise :class:`CLIConfigError` for any key or class the composed config names that does not exist."""

    #: Paths whose ``~key`` sets this value instead of deleting the key: where the key's absence means something
    #: on (a Trainer without ``logger`` makes Lightning's default logger), so that ``~key`` means "none".
    off_when_deleted: Mapping[tuple[str, ...], Any]


# ---------------------------------------------------------------------------------------------- files and groups


def search_path(files: Sequence[Path]) -> list[Path]:
    """Where config groups are looked up, first match wins: the first --config file's folder, then
    ``./conf``, then the checkout's ``conf/`` (so a printed config saved anywhere still finds the groups)."""
    candidates = [*(f.parent for f in files[:1]), Path("conf"), Path(__file__).resolve().parents[2] / "conf"]
    roots: list[Path] = []
    for folder in candidates:
        if folder.is_dir() and all(folder.resolve() != r.resolve() for r in roots):
            roots.append(folder)
    return roots


def load_yaml(path: Path) -> tuple[dict[str, Any], str | None]:
    """A YAML mapping, read by omegaconf (as Hydra reads it: ``1e-3`` is a float), and its ``# @package``
    header if any; interpolations stay unresolved until every override is in."""
    try:
        text = path.read_text()
        loaded = OmegaConf.load(path)
    except OSError as err:
        raise CLIConfigError(f"cannot read config file {str(path)!r}: {err.strerror}.") from None
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise CLIConfigError(f"{path} is not a valid YAML config: {err}") from None
    if not isinstance(loaded, DictConfig):
        raise CLIConfigError(f"{path} must hold a mapping of keys to values, not a list.")
    header = next((m[1] for line in text.splitlines()[:10] if (m := _PACKAGE_HEADER.match(line.strip()))), None)
    container = OmegaConf.to_container(loaded, resolve=False)
    return cast(dict[str, Any], container), header  # a DictConfig's container: omegaconf types it for any config


def config_file(path: str | Path) -> Path:
    """A --config argument as an existing file, or an error suggesting the nearest YAML file nearby."""
    path = Path(path)
    if path.is_file():
        return path
    folder = path.parent if path.parent.is_dir() else Path(".")
    nearby = [str(p) for p in folder.glob("*") if p.suffix in YAML_SUFFIXES]
    raise CLIConfigError(f"config file {str(path)!r} does not exist.{closest(str(path), nearby)}")


def merge(base: Any, other: Any) -> Any:
    """``other`` deep-merged onto ``base`` (lists and scalars replace); a changed ``class_path`` replaces."""
    if not (isinstance(base, dict) and isinstance(other, dict)):
        return copy.deepcopy(other)
    if "class_path" in other and base.get("class_path") not in (None, other["class_path"]):
        return copy.deepcopy(other)
    merged = dict(base)
    for key, value in other.items():
        merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
    return merged


def nest(data: dict, package: str) -> dict:
    """``data`` placed at the dotted ``package`` path."""
    if package in ("", GLOBAL_PACKAGE):
        return data
    for part in reversed(package.split(".")):
        data = {part: data}
    return data


class Composer:
    """Composes YAML files and their ``defaults:`` against the folders that hold config groups."""

    def __init__(self, roots: Sequence[Path], choices: dict[str, Any] | None = None) -> None:
        self.roots = list(roots)
        #: group -> option picked on the command line (None drops the group); wins over everything
        self.choices = dict(choices or {})
        #: group -> option from an ``override group: option`` defaults entry; the outermost file wins
        self.overrides: dict[str, Any] = {}
        self.used: set[str] = set()
        self._open: list[Path] = []  # files being composed, to refuse a defaults cycle

    def groups(self) -> list[str]:
        """Folders of YAML files under any root."""
        return sorted({p.name for root in self.roots for p in root.iterdir() if p.is_dir() and _has_yaml(p)})

    def options(self, group: str) -> list[str]:
        return sorted(
            {
                p.stem
                for root in self.roots
                if (root / group).is_dir()
                for p in (root / group).iterdir()
                if p.suffix in YAML_SUFFIXES
            }
        )

    def option_file(self, group: str, option: Any) -> Path | None:
        candidates = (root / group / f"{option}{suffix}" for root in self.roots for suffix in YAML_SUFFIXES)
        return next((path for path in candidates if path.is_file()), None)

    def file(self, path: Path, package: str = "") -> dict:
        if path.resolve() in self._open:
            raise CLIConfigError(f"defaults cycle: {' -> '.join(map(str, [*self._open, path.resolve()]))}.")
        self._open.append(path.resolve())
        try:
            return self._compose_file(path, package)
        finally:
            self._open.pop()

    def _compose_file(self, path: Path, package: str) -> dict:
        data, header = load_yaml(path)
        package = header if header is not None else package
        entries = [_DefaultsEntry.parse(entry, path) for entry in _defaults_list(data.pop("defaults", []), path)]
        for entry in entries:
            if entry.keyword == "override":
                if entry.group is None:
                    raise RuntimeError("lightning_zero internal error: a keyword comes with a group")
                self.overrides.setdefault(entry.group, entry.option)
        composed: dict = {}
        for entry in entries:
            if entry.keyword == "override":
                continue
            if entry.group == "_self_":
                composed = merge(composed, nest(data, package))
            elif entry.group is None:
                composed = merge(composed, self.file(self._sibling(path, entry.option), package))
            else:
                from_command_line = entry.group in self.choices
                option = self._choice(entry.group, entry.option)
                try:
                    composed = merge(composed, self.group(entry.group, option, optional=entry.keyword == "optional")[0])
                except CLIConfigError as err:
                    raise (err if from_command_line else CLIConfigError(f"{path}, defaults: {err}")) from None
        return composed

    def group(self, group: str, option: Any, optional: bool = False) -> tuple[dict, str]:
        """The composed option file of ``group``, and the package it lands in."""
        if option is None:
            return {}, group.replace("/", ".")
        path = self.option_file(group, option)
        if path is None:
            if optional:
                return {}, group.replace("/", ".")
            options = self.options(group)
            if not options:
                where = ", ".join(map(str, self.roots)) or "no conf/ folder"
                raise CLIConfigError(
                    f"config group {group!r} does not exist (looked in {where}); groups: {self.groups()}.{closest(group, self.groups())}"
                )
            raise CLIConfigError(
                f"{group}={option} names no {group}/{option}.yaml (looked in {', '.join(map(str, self.roots))}); "
                f"choose one of {options}.{closest(str(option), options)}"
            )
        header = load_yaml(path)[1]
        package = header if header is not None else group.replace("/", ".")
        return self.file(path, package=group.replace("/", ".")), package

    def unused(self) -> list[tuple[str, Any]]:
        """Groups picked on the command line that no defaults list mentions, in command-line order."""
        return [(g, o) for g, o in self.choices.items() if g not in self.used]

    def check_overrides_used(self) -> None:
        for group in self.overrides:
            if group not in self.used:
                raise CLIConfigError(
                    f"`override {group}: ...` in a defaults list matches no `{group}` entry of any defaults list."
                )

    def _choice(self, group: str, default: Any) -> Any:
        self.used.add(group)
        if group in self.choices:
            return self.choices[group]
        return self.overrides.get(group, default)

    def _sibling(self, path: Path, name: str) -> Path:
        for folder in (path.parent, *self.roots):
            for suffix in ("", *YAML_SUFFIXES):
                if (candidate := folder / f"{name}{suffix}").is_file():
                    return candidate
        raise CLIConfigError(f"{path}: defaults entry {name!r} names no file next to it or in {self.roots}.")


@dataclasses.dataclass(frozen=True)
class _DefaultsEntry:
    """``_self_``, a file name (``group`` None), or ``[override|optional] group: option``."""

    group: str | None
    option: Any
    keyword: str | None = None

    @classmethod
    def parse(cls, entry: Any, path: Path) -> _DefaultsEntry:
        if entry == "_self_":
            return cls("_self_", None)
        if isinstance(entry, str):
            return cls(None, entry)
        if isinstance(entry, dict) and len(entry) == 1:
            ((key, option),) = entry.items()
            words = str(key).split()
            if len(words) == 1 or (len(words) == 2 and words[0] in ("override", "optional")):
                return cls(words[-1].strip("/"), option, words[0] if len(words) == 2 else None)
        raise CLIConfigError(
            f"{path}: defaults entry {entry!r} must be `_self_`, a file name or `[override|optional] group: option`."
        )


def _defaults_list(defaults: Any, path: Path) -> list:
    if not isinstance(defaults, list):
        raise CLIConfigError(f"{path}: `defaults` must be a list, e.g. `defaults: [{{strategy: zero3}}, _self_]`.")
    return defaults if "_self_" in defaults else [*defaults, "_self_"]


def _has_yaml(folder: Path) -> bool:
    return any(p.suffix in YAML_SUFFIXES for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------- overrides


def _child(node: Any, part: str, path: Sequence[str]) -> Any:
    if isinstance(node, list):
        if not part.isdigit() or int(part) >= len(node):
            raise CLIConfigError(f"`{'.'.join(path)}` is a list of {len(node)}; {part!r} is not an index of it.")
        return node[int(part)]
    return node[part]


def get_path(config: dict, path: Sequence[str]) -> Any:
    node: Any = config
    for i, part in enumerate(path):
        node = _child(node, part, path[:i])
    return node


def set_path(config: dict, path: Sequence[str], value: Any) -> None:
    """Set ``path`` to ``value``, creating mappings on the way; list items are addressed by index."""
    node: Any = config
    for i, part in enumerate(path[:-1]):
        if isinstance(node, dict) and not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = _child(node, part, path[:i])
    if isinstance(node, list):
        _child(node, path[-1], path[:-1])  # an existing index, or the error
        node[int(path[-1])] = value
    else:
        node[path[-1]] = value


def delete_path(config: dict, path: Sequence[str]) -> None:
    parent = get_path(config, path[:-1])
    _child(parent, path[-1], path[:-1])
    del parent[int(path[-1]) if isinstance(parent, list) else path[-1]]


def apply_override(config: dict, override: Override, schema: Schema) -> None:
    path, exists = schema.locate(config, override.key)
    if override.op == "delete":
        off = schema.off_when_deleted.get(tuple(path), _MISSING)
        if not exists and off is _MISSING:
            raise CLIConfigError(
                f"{override.text}: {override.key} is not in the config, so there is nothing to delete."
            )
        current = get_path(config, path) if exists else None
        if exists and override.value is not None and current != override.parsed_value:
            raise CLIConfigError(f"{override.text}: {override.key} is {current!r}, not {override.value}.")
        if off is _MISSING:
            delete_path(config, path)
        else:  # absent, the key would mean "on" (Lightning's default logger): deleted, it means off
            set_path(config, path, off)
        return
    if exists and override.op == "add":
        raise CLIConfigError(
            f"{override.text}: {override.key} is already set (to {get_path(config, path)!r}); override it with "
            f"'{override.key}={override.value}' (or '++{override.key}={override.value}')."
        )
    set_path(config, path, override.parsed_value)


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """Every ``${...}`` interpolation replaced by its value."""
    try:
        container = OmegaConf.to_container(OmegaConf.create(config), resolve=True)
        return cast(dict[str, Any], container)  # a dict's container: omegaconf types it for any config
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        where = f" at {key}" if key else ""
        raise CLIConfigError(f"cannot resolve interpolation{where}: {getattr(err, 'msg', err)}") from None


def compose(command: CommandLine, schema: Schema, roots: Sequence[Path] | None = None) -> dict:
    """The config LightningCLI receives: files, their defaults, then the overrides, in command-line order.

    A group picked on the command line that no defaults list names replaces what its package holds (so
    ``strategy=zero2`` on a printed config swaps the whole strategy); ``~group`` then deletes that key.
    """
    return compose_keeping_interpolations(command, schema, roots)[0]


def compose_keeping_interpolations(
    command: CommandLine, schema: Schema, roots: Sequence[Path] | None = None
) -> tuple[dict, dict]:
    """:func:`compose`'s config, and the same config before its ``${...}`` were resolved: what a printed config
    must keep so that an override of the key they name still moves them (:func:`keep_interpolations`)."""
    files = [config_file(c) for c in command.configs]
    composer = Composer(search_path(files) if roots is None else roots)
    groups = set(composer.groups())
    key_overrides = []
    for override in command.overrides:
        if override.key in groups and override.op != "force":
            composer.choices[override.key] = None if override.op == "delete" else override.value
        else:
            key_overrides.append(override)
    config: dict = {}
    for path in files:
        config = merge(config, composer.file(path))
    composer.check_overrides_used()
    for group, option in composer.unused():
        if option is None:
            key_overrides.insert(0, Override(f"~{group}", "delete", group, None))
            continue
        content, package = composer.group(group, option)
        if package not in ("", GLOBAL_PACKAGE):
            located, exists = schema.locate(config, package)
            if exists:
                delete_path(config, located)
        config = merge(config, content)
    for override in key_overrides:
        try:
            apply_override(config, override, schema)
        except UnknownKeyError as err:
            if "." in override.key or err.suggestion or not groups:
                raise
            raise CLIConfigError(f"{err} Config groups: {sorted(groups)}.{closest(override.key, groups)}") from None
    resolved = resolve(config)
    schema.check(resolved)
    return resolved, config


# ---------------------------------------------------------------------------------------------- printed configs


def interpolations(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, str]]:
    """Every string value of ``node`` that holds a ``${...}``, with its path (list items by their index)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from interpolations(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from interpolations(value, (*path, index))
    elif isinstance(node, str) and "${" in node:
        yield path, node


def _lookup(node: Any, path: tuple) -> Any:
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return _MISSING
    return node


def _put(node: Any, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _resolved(config: DictConfig, path: tuple) -> Any:
    """The value at ``path`` with its interpolations resolved; :data:`_MISSING` if it does not resolve."""
    try:
        node: Any = config
        for part in path:
            node = node[part]
        return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    except (OmegaConfBaseException, KeyError, IndexError, TypeError):
        return _MISSING


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # 1 and True, 150 and 150.0 are different settings


def keep_interpolations(printed: dict, unresolved: dict) -> dict:
    """``printed`` (LightningCLI's ``--print_config``, every value resolved) with each ``${...}`` of the composed
    config (``unresolved``) put back at its path, so that the printed file, fed back with ``trainer.max_steps=5``,
    moves ``val_check_interval: ${trainer.max_steps}`` as the original config did.

    An interpolation is kept only where it still resolves, inside the printed config, to the printed value: a
    LightningCLI argument given after the config (``--trainer.max_steps 3``) changes the key it names but not the
    interpolations composed before it, and the printed config must still describe the run it printed; there, and
    where LightningCLI printed the key elsewhere or not at all, the value stays resolved. A value put back resolved
    may change what another interpolation gives, hence the passes; each drops a candidate, so they end."""
    candidates = [path for path, _ in interpolations(unresolved) if _lookup(printed, path) is not _MISSING]
    kept = copy.deepcopy(printed)
    for path in candidates:
        _put(kept, path, _lookup(unresolved, path))
    while candidates:
        try:
            config = OmegaConf.create(kept)
        except OmegaConfBaseException:
            return printed
        wrong = [path for path in candidates if not _same(_resolved(config, path), _lookup(printed, path))]
        if not wrong:
            break
        for path in wrong:
            _put(kept, path, copy.deepcopy(_lookup(printed, path)))
            candidates.remove(path)
    return kept
