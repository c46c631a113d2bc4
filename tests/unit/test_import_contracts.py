"""Every module sits in an import contract: `lint-imports` checks only the modules a contract names, so a module
added to a package with inner layers (engine/, strategy/) and left out of them would be free to import anything, and
a package left out of the top-level layers likewise."""

from __future__ import annotations

import configparser
import re

from tests.launch import REPO

PACKAGE = REPO / "lightning_zero"


def contracts() -> dict[str, dict[str, str]]:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    return {name.split(":")[-1]: dict(parser[name]) for name in parser.sections() if name.startswith("importlinter:")}


def layer_names(layers: str) -> set[str]:
    return {name for line in layers.splitlines() for name in re.split(r"\s*[|:]\s*", line.strip()) if name}


def children(package: str) -> set[str]:
    """The modules and subpackages directly inside ``package`` (dotted), ``__init__`` left out."""
    directory = PACKAGE.joinpath(*package.split(".")[1:])
    return {
        path.stem if path.suffix == ".py" else path.name
        for path in directory.iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }


def test_every_module_of_a_layered_package_is_in_its_layers():
    missing = []
    for name, contract in contracts().items():
        if contract.get("type") != "layers" or "containers" not in contract:
            continue
        named = layer_names(contract["layers"])
        for container in contract["containers"].split():
            missing += [f"{container}.{child} (contract {name})" for child in sorted(children(container) - named)]
    assert not missing, "modules in no layer of their package's contract:\n" + "\n".join(missing)


def test_every_package_is_in_the_top_level_layers():
    named = {module.removeprefix("lightning_zero.") for module in layer_names(contracts()["layers"]["layers"])}
    missing = sorted(children("lightning_zero") - named)
    assert not missing, f"packages and root modules in no layer of the `layers` contract: {missing}"
