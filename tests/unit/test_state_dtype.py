"""``engine/state_dtype.py`` on plain tensors: the bf16-held step against torch's optimizer with its state rounded to
bf16 after every step, tile by tile and slice by slice."""

import pytest
import torch

from lightning_zero.engine.state_dtype import StateDtype

SHAPES = [(37, 11), (5,), (300,), ()]
OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, foreach=True)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
]


def _emulated_step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    for entry in optimizer.state.values():
        for name, value in entry.items():
            if name != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim():
                value.copy_(value.to(torch.bfloat16))


def _train(cls, kwargs, step, steps: int = 12, seed: int = 0):
    torch.manual_seed(seed)
    params = [torch.randn(shape) for shape in SHAPES]
    optimizer = cls(params, **kwargs)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape)
        params[2].grad = None if _ % 3 == 1 else params[2].grad  # a tensor that sits some steps out
        step(optimizer)
    return params, optimizer


@pytest.mark.parametrize(("cls", "kwargs"), OPTIMIZERS, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("tile", [64, 2**22], ids=["sliced", "whole"])
def test_the_held_step_equals_rounding_after_every_step(cls, kwargs, tile):
    """Tiles of 64 elements slice the 407-element tensor into 7 steps of its own, each from the same step count."""
    states = StateDtype("bf16", tile_elements=tile)
    held, optimizer = _train(cls, kwargs, states.step)
    emulated, reference = _train(cls, kwargs, _emulated_step)
    for a, b in zip(held, emulated):
        assert torch.equal(a, b)
    for a, b in zip(held, emulated):
        for name, value in optimizer.state[a].items():
            other = reference.state[b][name]
            if name == "step" or a.dim() == 0:  # a 0-dim parameter's state stays as made
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other))
                continue
            assert value.dtype == torch.bfloat16
            assert torch.equal(value.float(), other)


def test_fp32_steps_the_optimizer_as_it_is():
    states = StateDtype("fp32")
    held, optimizer = _train(torch.optim.AdamW, {}, states.step)
    plain, _ = _train(torch.optim.AdamW, {}, lambda optimizer: optimizer.step())
    assert all(torch.equal(a, b) for a, b in zip(held, plain))
    assert {v.dtype for entry in optimizer.state.values() for v in entry.values()} == {torch.float32}


def test_state_is_held_in_the_tensors_it_was_rounded_into():
    """A whole tensor's bf16 state is written back into the same storage every step (host pages stay touched)."""
    states = StateDtype("bf16")
    p = torch.randn(10)
    optimizer = torch.optim.AdamW([p])
    p.grad = torch.randn(10)
    states.step(optimizer)
    first = optimizer.state[p]["exp_avg"]
    p.grad = torch.randn(10)
    states.step(optimizer)
    assert optimizer.state[p]["exp_avg"] is first


def test_bf16_parameters_keep_their_own_state():
    states = StateDtype("bf16")
    p = torch.randn(10, dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([p])
    p.grad = torch.randn(10, dtype=torch.bfloat16)
    states.step(optimizer)
    assert optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
    assert states.held_for(p) == torch.bfloat16


def test_an_optimizer_with_step_hooks_is_widened_whole():
    """A hook would see each tile as a step of its own: it is called once."""
    states = StateDtype("bf16", tile_elements=4)
    p = torch.randn(40)
    optimizer = torch.optim.AdamW([p])
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    for _ in range(3):
        p.grad = torch.randn(40)
        states.step(optimizer)
    assert len(calls) == 3
    assert optimizer.state[p]["exp_avg"].dtype == torch.bfloat16
    # Widened whole, the fp32 state is this step's only: kept, it would hold what bf16 was to save.
    assert sum(buffer.numel() for buffer in states._scratch.values()) == 0


def test_scalar_state_and_0_dim_parameters_keep_their_dtype():
    """NAdam's ``mu_product`` is 0-dim like a 0-dim parameter: neither is narrowed."""
    states = StateDtype("bf16")
    params = [torch.randn(8), torch.randn(())]
    optimizer = torch.optim.NAdam(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape)
        states.step(optimizer)
    assert optimizer.state[params[0]]["exp_avg"].dtype == torch.bfloat16
    assert optimizer.state[params[0]]["mu_product"].dtype == torch.float32
    assert optimizer.state[params[1]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_loaded_state_is_conformed_to_the_run(name, dtype):
    p = torch.randn(6)
    optimizer = torch.optim.AdamW([p])
    optimizer.state[p] = {
        "step": torch.tensor(3.0),
        "exp_avg": torch.randn(6, dtype=torch.bfloat16 if name == "fp32" else torch.float32),
        "exp_avg_sq": torch.rand(6, dtype=torch.bfloat16 if name == "fp32" else torch.float32),
    }
    StateDtype(name).conform(optimizer)
    assert optimizer.state[p]["exp_avg"].dtype == dtype
    assert optimizer.state[p]["exp_avg_sq"].dtype == dtype
    assert optimizer.state[p]["step"].dtype == torch.float32
