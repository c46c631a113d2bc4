"""The torch version adapters (``lightning_zero/torch_versions/``): the admitted range, the warning outside it, the
rule that torch's private APIs are used only there, and each adapter's branch on the installed torch (``make
test-torch`` runs this module under every admitted release)."""

from __future__ import annotations

import ast
import configparser
import re
import warnings

import pytest
import torch
import torch.distributed as dist

from lightning_zero import torch_versions
from lightning_zero.engine.optimizers import hosted_params
from lightning_zero.engine.stage3 import fsdp2_private
from lightning_zero.torch_versions import optim, pipelining
from tests.launch import REPO
from tests.unit.one_rank import one_rank_world

PACKAGE = REPO / "lightning_zero"
#: Private torch names allowed outside the adapters: the ``_foreach_*`` kernels, which ``torch.optim``'s own
#: implementations call and which every admitted release has.
ALLOWED = re.compile(r"torch\._foreach_\w+$")


def _private_torch_uses(path) -> list[str]:
    """Imports of a private torch module and reads of ``torch._name`` in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "torch" and any(part.startswith("_") for part in parts[1:]):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: import {module}")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            name = _dotted(node)
            if name and name.split(".")[0] in ("torch", "nn") and not ALLOWED.match(name):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"torch(\.\w+)*\._\w+(\.\w+)*", node.value)
        ):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    return found


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attributes on a name; None for anything else (a call's result, a subscript)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


#: FSDP2's one door: the stage-3 engine's reads of FSDP2's objects, with FSDP2's per-release differences beside them.
FSDP2_DOOR = PACKAGE / "engine" / "stage3" / "fsdp2_private.py"


def test_torch_private_apis_are_used_only_in_the_adapters():
    sources = [p for p in PACKAGE.rglob("*.py") if "torch_versions" not in p.parts and p != FSDP2_DOOR]
    assert len(sources) > 100
    found = [use for path in sources for use in _private_torch_uses(path)]
    assert found == []


def test_the_scan_sees_each_kind_of_private_use():
    sample = REPO / "lightning_zero" / "_sample_for_the_scan.py"
    try:
        sample.write_text(
            "import torch\nfrom torch.utils._pytree import tree_map\nimport torch._dynamo\n"
            "torch._chunk_cat([], 0, 2)\ntorch._foreach_mul_([], 2.0)\nname = 'torch.distributed._composable'\n"
            "base = nn.modules.batchnorm._NormBase\nversion = torch.__version__\n"
        )
        found = _private_torch_uses(sample)
    finally:
        sample.unlink()
    assert sorted(use.split(": ", 1)[1] for use in found) == [
        "'torch.distributed._composable'",
        "import torch._dynamo",
        "import torch.utils._pytree",
        "import torch.utils._pytree.tree_map",
        "nn.modules.batchnorm._NormBase",
        "torch._chunk_cat",
    ]


def test_setup_cfg_admits_the_tested_range_and_the_installed_torch_lies_in_it():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    torch_line = next(line for line in config["options"]["install_requires"].split("\n") if line.startswith("torch"))
    (low,), (high,) = re.findall(r">=([\d.]+)", torch_line), re.findall(r"<([\d.]+)", torch_line)
    oldest, newest = torch_versions.OLDEST_TESTED, torch_versions.NEWEST_TESTED
    assert low == f"{oldest[0]}.{oldest[1]}" and high == f"{newest[0]}.{newest[1] + 1}", torch_line
    assert oldest <= torch_versions.release(torch.__version__) <= newest


@pytest.mark.parametrize(
    "version, warns",
    [
        ("2.11.0", False),
        ("2.14.1+cu130", False),
        ("2.14.0a0+git4f3e2a1", False),
        ("2.13.0+cpu", False),
        ("2.10.1", True),
        ("2.15.0", True),
        ("2.15.0.dev20261201+cpu", True),
        ("3.0.0", True),
    ],
)
def test_a_torch_outside_the_tested_range_warns_naming_the_range(version, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch_versions.warn_if_untested(version) is warns
    messages = [str(w.message) for w in caught if issubclass(w.category, torch_versions.UntestedTorchWarning)]
    assert len(messages) == warns
    if warns:
        assert f"torch 2.11 through 2.14; torch {version} is outside that range" in messages[0]


def test_importing_the_package_under_the_installed_torch_warns_nothing():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning:lightning_zero", "-c", "import lightning_zero"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


def test_a_missing_feature_raises_naming_it():
    error = torch_versions.TorchFeatureMissing("FSDP2's parameter groups on FSDPState", "_fsdp_param_groups")
    assert str(error).startswith(f"torch {torch.__version__}: FSDP2's parameter groups on FSDPState was not found")
    assert "tested with torch 2.11 through 2.14" in str(error)


def test_every_branch_is_named_for_the_installed_torch():
    branches = {**torch_versions.branches(), **fsdp2_private.branches()}
    assert set(branches) == {
        "FSDP2 parameter groups per fully_shard call",
        "FSDP2's mixed precision for a complex parameter",
        "Adagrad's state for a stand-in",
        "pipelining's first-step warm-up",
    }
    assert all("torch 2." in branch for branch in branches.values())


@pytest.mark.parametrize("fused", [False, True])
def test_adagrad_steps_stand_ins_as_it_steps_its_own_parameters(fused):
    """torch 2.11's Adagrad makes its state only in its constructor ([Note: state made in the constructor]); a
    stand-in (a shard, a host copy) must step exactly as the parameter would, on every release."""
    torch.manual_seed(0)
    own = torch.nn.Parameter(torch.randn(6, 3))
    standin = own.detach().clone()
    reference = torch.optim.Adagrad([own], lr=0.1, initial_accumulator_value=0.3, weight_decay=0.01, fused=fused)
    hosting = torch.optim.Adagrad(
        [torch.nn.Parameter(own.detach().clone())],
        lr=0.1,
        initial_accumulator_value=0.3,
        weight_decay=0.01,
        fused=fused,
    )
    param = hosting.param_groups[0]["params"][0]
    for step in range(3):
        grad = torch.randn(6, 3)
        own.grad = grad.clone()
        reference.step()
        with hosted_params(hosting, {id(param): (standin, grad.clone())}):
            hosting.step()
    torch.testing.assert_close(standin, own.detach(), rtol=0, atol=0)
    torch.testing.assert_close(hosting.state[standin]["sum"], reference.state[own]["sum"], rtol=0, atol=0)
    assert hosting.state[standin]["step"].item() == 3


def test_the_probe_finds_which_optimizers_make_state_in_their_step():
    for name in ("SGD", "Adam", "AdamW", "RMSprop"):
        assert optim.makes_state_when_stepped(getattr(torch.optim, name))
    lazy = optim.makes_state_when_stepped(torch.optim.Adagrad)
    assert ("made by its own step" in torch_versions.branches()["Adagrad's state for a stand-in"]) is lazy


@pytest.fixture
def one_rank_group():
    with one_rank_world() as group:
        yield group


def test_the_neighbour_exchange_leaves_out_only_a_stage_s_own_rank(one_rank_group):
    """[Note: a stage's neighbour on its own rank]: a V-shaped schedule's turn sits on one rank, which gloo cannot
    send to; the same rank's send and receive go together, so nothing is left unpaired."""
    tensor = torch.zeros(1)
    ops = [
        dist.P2POp(dist.isend, tensor, group_peer=0, group=one_rank_group),
        dist.P2POp(dist.irecv, tensor, group_peer=0, group=one_rank_group),
    ]
    assert pipelining.neighbour_exchange(ops, group_rank=0) == []
    assert pipelining.neighbour_exchange(ops, group_rank=1) == ops
