"""The errors of composing a ``lightning-zero`` config, shared by the command-line parser, the composition and
the schema: each names the file, group, override or key at fault and, where one exists, the nearest valid choice."""

from __future__ import annotations


class CLIConfigError(ValueError):
    """A config file, group or override that cannot be composed; the message names it and suggests a fix."""


class UnknownKeyError(CLIConfigError):
    """A key that exists neither in the config nor in what LightningCLI accepts there."""

    def __init__(self, message: str, suggestion: str | None) -> None:
        super().__init__(message)
        self.suggestion = suggestion
