"""``lightning-zero <subcommand>`` arguments: which are config files, which Hydra-style overrides, which LightningCLI's.

* ``--config FILE`` (or ``-c``, ``--config=FILE``) names a file to compose; every one goes in first, at the
  place of the first, so no LightningCLI argument may stand between two of them.
* ``key=value``, ``+key=value``, ``++key=value`` and ``~key`` are :class:`Override` tokens, unless they are
  the value of a LightningCLI option before them (``--trainer.logger x=1``); their values are typed by
  Hydra's rules (:func:`parse_value`).
* Everything else is LightningCLI's, passed through in order.

Parsing only splits the tokens; :func:`~lightning_zero.cli.compose.compose` gives them their meaning.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, Literal

import yaml

from lightning_zero.cli.errors import CLIConfigError

SUBCOMMANDS = ("fit", "validate", "test", "predict")
_OVERRIDE = re.compile(r"(?P<prefix>\+\+|\+|~)?(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)(?:=(?P<value>.*))?", re.DOTALL)
_INT = re.compile(r"[-+]?\d+")
_FLOAT = re.compile(r"[-+]?(\d+\.\d*|\.\d+|\d+)([eE][-+]?\d+)?|[-+]?(inf|nan)", re.IGNORECASE)
_NEGATIVE_NUMBER = re.compile(r"-\d[\d.eE+-]*")
#: What an override's prefix asks for.
_Op = Literal["set", "add", "force", "delete"]
_OPS: dict[str | None, _Op] = {None: "set", "+": "add", "++": "force", "~": "delete"}
#: Options of LightningCLI that take no value, so a ``key=value`` after them is an override, not their value.
_FLAGS = ("--print_config", "--help", "-h")


def _is_option(token: str) -> bool:
    return token.startswith("-") and not _NEGATIVE_NUMBER.fullmatch(token)


@dataclasses.dataclass(frozen=True)
class Override:
    """One Hydra-style command-line token: ``key=value``, ``+key=value``, ``++key=value`` or ``~key``."""

    text: str
    op: _Op
    key: str
    value: str | None

    @classmethod
    def parse(cls, token: str) -> Override | None:
        match = _OVERRIDE.fullmatch(token)
        if match is None or (match["value"] is None and match["prefix"] != "~"):
            return None
        return cls(token, _OPS[match["prefix"]], match["key"], match["value"])

    @property
    def parsed_value(self) -> Any:
        return parse_value(self.value) if self.value is not None else None


def parse_value(text: str) -> Any:
    """A command-line value by Hydra's rules: ``true``/``false``, ``null``, integers, floats (``1e-3``
    too) and ``[...]``/``{...}`` collections are typed; quotes make a string; anything else stays the
    string it is (``exp #1``, ``1:30``, ``yes``, ``2024-01-01``), and ``${...}`` is kept for interpolation."""
    stripped = text.strip()
    if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
        return stripped[1:-1]
    lowered = stripped.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "null":
        return None
    if _INT.fullmatch(stripped):
        return int(stripped)
    if _FLOAT.fullmatch(stripped):
        return float(stripped)
    if stripped[:1] in ("[", "{"):
        try:
            return yaml.safe_load(stripped)
        except yaml.YAMLError as err:
            raise CLIConfigError(f"cannot read {text!r} as a list or mapping: {err}") from None
    return text


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
                value = token.split("=", 1)[1] if "=" in token else (rest[i + 1] if i + 1 < len(rest) else "")
                if not value:
                    raise CLIConfigError("--config needs a file: `--config conf/gpt_zero3.yaml`.")
                if slot is not None and len(cli_args) > slot:
                    raise CLIConfigError(
                        f"{cli_args[slot]!r} stands between two --config files; every --config file is composed "
                        "first, so put the --config files before other arguments."
                    )
                configs.append(value)
                slot = len(cli_args) if slot is None else slot
                i += 1 if "=" in token else 2
                continue
            previous = rest[i - 1] if i else ""
            is_value = _is_option(previous) and "=" not in previous and previous not in _FLAGS
            override = None if _is_option(token) or is_value else Override.parse(token)
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
