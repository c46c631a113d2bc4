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
* ``${...}`` is omegaconf interpolation, resolved after every override, as Hydra resolves lazily.

Merging is LightningCLI-aware: a node whose ``class_path`` changes is replaced, never deep-merged, so no
argument of the old class leaks into the new one. Which keys exist, and the shorthands (``model.n_layer``
for ``model.init_args.n_layer``), come from a :class:`Schema`: see :mod:`lightning_zero.cli.schema`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

SUBCOMMANDS = ("fit", "validate", "test", "predict")
GLOBAL_PACKAGE = "_global_"
YAML_SUFFIXES = (".yaml", ".yml")
_OVERRIDE = re.compile(r"(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)(?:=(?P<value>.*))?", re.DOTALL)
_PACKAGE_HEADER = re.compile(r"#\s*@package\s+(\S+)")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)")
#: Options of LightningCLI that take no value, so a ``key=value`` after them is an override, not their value.
_FLAGS = ("--print_config", "--help", "-h")


class CLIConfigError(ValueError):
    """A config file, group or override that cannot be composed; the message names it and suggests a fix."""


def closest(value: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the nearest choice, or an empty string."""
    matches = difflib.get_close_matches(value, sorted(set(choices)), n=1, cutoff=0.6)
    return f" Did you mean {matches[0]!r}?" if matches else ""


# ---------------------------------------------------------------------------------------------- command line


@dataclasses.dataclass(frozen=True)
class Override:
    """One Hydra-style command-line token: ``key=value``, ``+key=value``, ``++key=value`` or ``~key``."""

    text: str
    op: Literal["set", "add", "force", "delete"]
    key: str
    value: str | None

    @classmethod
    def parse(cls, token: str) -> Override | None:
        match = _OVERRIDE.fullmatch(token)
        if match is None or (match["value"] is None and match["prefix"] != "~"):
            return None
        op = {None: "set", "+": "add", "++": "force", "~": "delete"}[match["prefix"]]
        return cls(token, op, match["key"], match["value"])

    @property
    def parsed_value(self) -> Any:
        return parse_value(self.value) if self.value is not None else None


def parse_value(text: str) -> Any:
    """A command-line value as YAML would read it (``3``, ``true``, ``null``, ``[1, 2]``, ``{a: 1}``), with
    ``1e-3`` a float as well (YAML 1.1 wants ``1.0e-3``), and ``${...}`` kept for interpolation."""
    if text == "":
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _FLOAT.fullmatch(value):
        return float(value)
    return value


@dataclasses.dataclass
class CommandLine:
    """``lightning-zero <subcommand>`` arguments, split into what we compose and what LightningCLI parses."""

    subcommand: str
    configs: list[str]
    overrides: list[Override]
    #: LightningCLI's own arguments, in order; the composed config goes in at ``config_slot``.
    cli_args: list[str]
    config_slot: int

    @classmethod
    def parse(cls, argv: Sequence[str]) -> CommandLine:
        subcommand, rest = argv[0], list(argv[1:])
        configs: list[str] = []
        overrides: list[Override] = []
        cli_args: list[str] = []
        slot: int | None = None
        i = 0
        while i < len(rest):
            token = rest[i]
            if token in ("--config", "-c") or token.startswith("--config="):
                if "=" in token:
                    configs.append(token.split("=", 1)[1])
                    i += 1
                elif i + 1 < len(rest):
                    configs.append(rest[i + 1])
                    i += 2
                else:
                    raise CLIConfigError("--config needs a file: `--config conf/gpt_zero3.yaml`.")
                slot = len(cli_args) if slot is None else slot
                continue
            previous = rest[i - 1] if i else ""
            is_value = previous.startswith("-") and "=" not in previous and previous not in _FLAGS
            override = None if token.startswith("-") or is_value else Override.parse(token)
            if override is not None:
                overrides.append(override)
            else:
                cli_args.append(token)
            i += 1
        return cls(subcommand, configs, overrides, cli_args, 0 if slot is None else slot)

    @property
    def composes(self) -> bool:
        """False for plain LightningCLI usage, which then goes through untouched."""
        return bool(self.configs or self.overrides)

    def lightning_argv(self, composed: dict) -> list[str]:
        """The argv LightningCLI parses: the composed config (inline YAML) where the first --config was."""
        inline = yaml.safe_dump(composed, sort_keys=False, default_flow_style=False)
        args = list(self.cli_args)
        args[self.config_slot : self.config_slot] = ["--config", inline]
        return [self.subcommand, *args]


# ---------------------------------------------------------------------------------------------- schema


class Schema(Protocol):
    """What the composition needs to know about the keys LightningCLI accepts."""

    def locate(self, config: dict, key: str) -> tuple[list[str], bool]:
        """The path ``key`` stands for in ``config`` (shorthands expanded) and whether it exists there;
        raises :class:`CLIConfigError` for a key that cannot exist, with the nearest valid one."""

    def check(self, config: dict) -> None:
        """Raise :class:`CLIConfigError` for any key or class the composed config names that does not exist."""


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


def load_yaml(path: Path) -> tuple[dict, str | None]:
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
    return OmegaConf.to_container(loaded, resolve=False), header


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
        #: group -> option picked on the command line (None drops the group)
        self.choices = dict(choices or {})
        self.used: set[str] = set()
        self._open: list[Path] = []  # files being composed, to refuse a defaults cycle

    def groups(self) -> list[str]:
        return sorted({p.name for root in self.roots for p in root.iterdir() if p.is_dir()})

    def folder(self, group: str) -> Path | None:
        return next((root / group for root in self.roots if (root / group).is_dir()), None)

    def options(self, group: str) -> list[str]:
        folder = self.folder(group)
        return sorted(p.stem for p in folder.iterdir() if p.suffix in YAML_SUFFIXES) if folder else []

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
        defaults = data.pop("defaults", [])
        if not isinstance(defaults, list):
            raise CLIConfigError(f"{path}: `defaults` must be a list, e.g. `defaults: [{{strategy: zero3}}, _self_]`.")
        if "_self_" not in defaults:
            defaults = [*defaults, "_self_"]
        own = nest(data, header if header is not None else package)
        composed: dict = {}
        for entry in defaults:
            if entry == "_self_":
                composed = merge(composed, own)
            elif isinstance(entry, str):
                composed = merge(composed, self.file(self._sibling(path, entry)))
            elif isinstance(entry, dict) and len(entry) == 1:
                (key, option), = entry.items()
                words = str(key).split()
                group = words[-1].strip("/")
                if len(words) > 2 or (len(words) == 2 and words[0] not in ("override", "optional")):
                    raise CLIConfigError(f"{path}: defaults entry {entry!r} is not `group: option`.")
                from_file = group not in self.choices
                try:
                    picked = self.group(group, self._choice(group, option), optional=words[0] == "optional")
                except CLIConfigError as err:
                    raise (CLIConfigError(f"{path}, defaults: {err}") if from_file else err) from None
                composed = merge(composed, picked)
            else:
                raise CLIConfigError(f"{path}: defaults entry {entry!r} must be `_self_`, a file name or `group: option`.")
        return composed

    def group(self, group: str, option: Any, optional: bool = False) -> dict:
        if option is None:
            return {}
        folder = self.folder(group)
        path = next((folder / f"{option}{s}" for s in YAML_SUFFIXES if (folder / f"{option}{s}").is_file()), None) if folder else None
        if path is None:
            if optional:
                return {}
            if folder is None:
                where = ", ".join(map(str, self.roots)) or "no conf/ folder"
                raise CLIConfigError(
                    f"config group {group!r} does not exist (looked in {where}); groups: {self.groups()}.{closest(group, self.groups())}"
                )
            options = self.options(group)
            raise CLIConfigError(
                f"{group}={option} names no file {folder}/{option}.yaml; choose one of {options}.{closest(str(option), options)}"
            )
        return self.file(path, package=group.replace("/", "."))

    def unused(self) -> list[tuple[str, str | None]]:
        """Groups picked on the command line that no defaults list mentions, in command-line order."""
        return [(g, o) for g, o in self.choices.items() if g not in self.used]

    def _choice(self, group: str, default: Any) -> Any:
        if group in self.choices:
            self.used.add(group)
            return self.choices[group]
        return default

    def _sibling(self, path: Path, name: str) -> Path:
        for folder in (path.parent, *self.roots):
            for suffix in ("", *YAML_SUFFIXES):
                if (candidate := folder / f"{name}{suffix}").is_file():
                    return candidate
        raise CLIConfigError(f"{path}: defaults entry {name!r} names no file next to it or in {self.roots}.")


# ---------------------------------------------------------------------------------------------- overrides


def _get(config: dict, path: Sequence[str]) -> Any:
    node: Any = config
    for part in path:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def apply_override(config: dict, override: Override, schema: Schema) -> None:
    path, exists = schema.locate(config, override.key)
    *parents, last = path
    if override.op == "delete":
        if exists:
            if override.value is not None and _get(config, path) != override.parsed_value:
                raise CLIConfigError(f"{override.text}: {override.key} is {_get(config, path)!r}, not {override.value}.")
            del _get(config, parents)[last]
        return
    if exists and override.op == "add":
        raise CLIConfigError(
            f"{override.text}: {override.key} is already set (to {_get(config, path)!r}); override it with "
            f"'{override.key}={override.value}' (or '++{override.key}={override.value}')."
        )
    node = config
    for part in parents:
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if not isinstance(node.get(part), (dict, list)):
            node[part] = {}
        node = node[part]
    node[last] = override.parsed_value


def resolve(config: dict) -> dict:
    """Every ``${...}`` interpolation replaced by its value."""
    try:
        return OmegaConf.to_container(OmegaConf.create(config), resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        where = f" at {key}" if key else ""
        raise CLIConfigError(f"cannot resolve interpolation{where}: {getattr(err, 'msg', err)}") from None


def compose(command: CommandLine, schema: Schema, roots: Sequence[Path] | None = None) -> dict:
    """The config LightningCLI receives: files, their defaults, then the overrides, in command-line order."""
    files = [config_file(c) for c in command.configs]
    composer = Composer(search_path(files) if roots is None else roots)
    groups = set(composer.groups())
    key_overrides = []
    for override in command.overrides:
        if override.key in groups and override.op != "force":
            composer.choices[override.key] = None if override.op == "delete" else override.parsed_value
        else:
            key_overrides.append(override)
    config: dict = {}
    for path in files:
        config = merge(config, composer.file(path))
    for group, option in composer.unused():
        config = merge(config, composer.group(group, option))
    for override in key_overrides:
        try:
            apply_override(config, override, schema)
        except CLIConfigError as err:
            if "." not in override.key and groups and "Did you mean" not in str(err):
                err = CLIConfigError(f"{err} Config groups: {sorted(groups)}.{closest(override.key, groups)}")
            raise err from None
    config = resolve(config)
    schema.check(config)
    return config
