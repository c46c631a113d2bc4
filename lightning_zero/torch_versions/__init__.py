"""torch's private APIs, behind one adapter per area, each version difference a named branch chosen by a probe.

[Note: version adapters]
``lightning_zero`` admits torch 2.11 through 2.14 (``setup.cfg``; ``make test-torch`` runs the distributed cases under
each). Everything it needs from torch that torch does not promise to keep (a private module, a private function, an
attribute of a private class) is imported or read here, one module per area: :mod:`.dtensor`, :mod:`.dcp`,
:mod:`.tracing` (fake tensors, the memory tracker, pytrees), :mod:`.pipelining`, :mod:`.optim`, :mod:`.autograd`,
:mod:`.nn` and :mod:`.tensors` (kernels torch exports only privately), or in FSDP2's one door,
``engine/stage3/fsdp2_private.py``, which reads FSDP2's objects for the stage-3 engine and keeps FSDP2's per-release
differences beside them (its own ``branches()``); ``tests/unit/test_torch_versions.py`` scans the package for
private uses anywhere else. Where releases differ, the adapter probes for the feature itself, not the
version string (NGC and source builds report versions such as ``2.14.0a0+git...``), and the branch it takes is named
in :func:`branches`. A probe that finds neither known form raises :class:`TorchFeatureMissing`, naming what it
looked for: a wrong number is never the fallback.

The one thing read from the version string is whether it lies in the tested range: outside it, importing
``lightning_zero`` warns (:class:`UntestedTorchWarning`) and goes on, since a release can keep every probed feature.
"""

from __future__ import annotations

import re
import warnings

import torch

__all__ = [
    "OLDEST_TESTED",
    "NEWEST_TESTED",
    "TorchFeatureMissing",
    "UntestedTorchWarning",
    "branches",
    "release",
    "warn_if_untested",
]

#: The oldest and newest torch releases (major, minor) ``make test-torch`` runs; ``setup.cfg`` admits the same.
OLDEST_TESTED = (2, 11)
NEWEST_TESTED = (2, 14)


class TorchFeatureMissing(RuntimeError):
    """The installed torch has none of the known forms of a private feature ``lightning_zero`` relies on."""

    def __init__(self, feature: str, looked_for: str) -> None:
        super().__init__(
            f"torch {torch.__version__}: {feature} was not found (looked for {looked_for}). lightning_zero is tested "
            f"with torch {_tested_range()}; install one of those, or report this message."
        )


class UntestedTorchWarning(UserWarning):
    """torch's version lies outside the range ``lightning_zero`` is tested on."""


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``2.14.1+cu130``, ``2.14.0a0+git4f3e2a1``), None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def warn_if_untested(version: str | None = None) -> bool:
    """Warn when ``version`` (the installed torch's by default) lies outside the tested range; True if it does."""
    version = torch.__version__ if version is None else version
    found = release(version)
    if found is not None and OLDEST_TESTED <= found <= NEWEST_TESTED:
        return False
    warnings.warn(
        f"lightning_zero is tested with torch {_tested_range()}; torch {version} is outside that range. It may work "
        "(lightning_zero checks the private torch features it uses and fails naming one that is missing), but no "
        "test has run on it.",
        UntestedTorchWarning,
        stacklevel=3,
    )
    return True


def branches() -> dict[str, str]:
    """Each version difference the adapters know, and the branch the installed torch takes (for reports)."""
    from lightning_zero.torch_versions import optim, pipelining

    return {**optim.branches(), **pipelining.branches()}


def _tested_range() -> str:
    return f"{OLDEST_TESTED[0]}.{OLDEST_TESTED[1]} through {NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}"
