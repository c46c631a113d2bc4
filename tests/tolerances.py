"""How far two fp32 trainings may end apart and still count as the same numbers (tests/README.md, "Tolerances").

Two runs whose arithmetic is the same operation for operation end bit for bit equal: those tests assert 0.0. Two runs
that compute the same sums in another order (ZeRO's reduce-scatter against DDP's all-reduce, a gathered weight's
memory layout picking another BLAS kernel, a checkpointed block recomputed) round differently, and which kernels a
CPU runs is not wholly ours to fix (``tests/conftest.py`` pins ATen's loops and MKL's and oneDNN's code paths, not
every library's blocking by size and thread count). Their bound is derived here from the run itself, never chosen to
pass on one machine:

* the measured distance of an equally valid run from the reference (DDP's own distance from the single-process
  run, where a test measures it), times :data:`REFERENCE_FACTOR`: another summation order moves the weights by
  about as much as the one measured;
* with a floor from fp32 rounding scaled by the learning rate and the number of steps, since that distance can be
  0: Adam's step is about ``lr`` per element whatever the gradient's size, so a relative difference ``r`` in a
  gradient moves its weight by up to ``lr * r`` per step. A gradient summed from ``n`` terms in two orders differs
  by up to ``n * 2**-24`` of the terms' magnitude, and by that times ``k`` relative to a sum that cancels ``k``-fold;
  :data:`REORDERED_RELATIVE` allows ``n * k <= 2**12`` (a few dozen rows a batch, two ranks, sums cancelling by up to
  two decades). A gradient that cancels to its own rounding (an element whose sign rounding decides) can move its
  weight by ``lr`` a step in either order: such a model needs DDP's measured distance, not the floor (no test in the
  suite measures one yet: every comparison against ddp uses the floor).
  Plain SGD moves a weight by ``lr * |g| * r``, less than Adam's, so the floor holds for it too.
"""

from __future__ import annotations

#: fp32's unit roundoff.
FP32_ROUNDING = 2.0**-24
#: The largest relative difference reordered fp32 sums leave in a gradient element (see the module docstring).
REORDERED_RELATIVE = 2.0**12 * FP32_ROUNDING
#: How much farther than an equally valid run's measured distance another order may end.
REFERENCE_FACTOR = 4.0


def reordered_fp32(lr: float, steps: int, reference: float = 0.0) -> float:
    """The bound for two fp32 trainings of ``steps`` optimizer steps at learning rate ``lr`` (the largest of the
    param groups') that differ only in the order of their roundings; ``reference`` is the measured distance of an
    equally valid run from the reference run, where the test has one."""
    if lr <= 0 or steps <= 0:
        raise ValueError(f"lr and steps must be positive, got lr={lr}, steps={steps}")
    return max(REFERENCE_FACTOR * reference, lr * steps * REORDERED_RELATIVE)


def assert_reordered_fp32(case: str, diff: float, lr: float, steps: int, reference: float = 0.0) -> None:
    bound = reordered_fp32(lr, steps, reference)
    assert diff <= bound, (
        f"{case}: {diff:.3g} apart, beyond the bound for reordered fp32 arithmetic ({bound:.3g}: lr={lr:g}, "
        f"steps={steps}, reference distance {reference:.3g}; tests/tolerances.py)"
    )


def reordered_fp32_moments(steps: int, magnitude: float) -> float:
    """The bound for the optimizer state (Adam's moments) of two fp32 trainings of ``steps`` optimizer steps that
    differ only in the order of their roundings; ``magnitude`` is the largest element of the reference run's state.
    A moment is an average of the steps' gradients (or of their squares, which doubles a relative difference), each
    of which may differ by :data:`REORDERED_RELATIVE` of its size, and the weights' drift feeds back into every later
    gradient: up to ``steps`` such differences, each relative to the moments' size."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got steps={steps}")
    return 2 * steps * REORDERED_RELATIVE * magnitude


def assert_reordered_fp32_moments(case: str, diff: float, steps: int, magnitude: float) -> None:
    bound = reordered_fp32_moments(steps, magnitude)
    assert diff <= bound, (
        f"{case}: optimizer state {diff:.3g} apart, beyond the bound for reordered fp32 arithmetic ({bound:.3g}: "
        f"steps={steps}, largest moment {magnitude:.3g}; tests/tolerances.py)"
    )


def reordered_fp32_loss(loss: float, steps: int) -> float:
    """The bound for a loss of two fp32 trainings that differ only in the order of their roundings, ``steps``
    optimizer steps in, ``loss`` its size (the largest of the reference's). The loss is itself a sum of many terms,
    rounded differently by up to :data:`REORDERED_RELATIVE` of its size, and each step before it, its update
    reordered, may move it by as much again: a scaling from the loss's own magnitude (the weights' bound says
    nothing of a loss's sensitivity to them), not a bound proven for every model."""
    if steps < 0:
        raise ValueError(f"steps must not be negative, got steps={steps}")
    return (steps + 1) * REORDERED_RELATIVE * abs(loss)


def assert_reordered_fp32_loss(case: str, diff: float, loss: float, steps: int) -> None:
    bound = reordered_fp32_loss(loss, steps)
    assert diff <= bound, (
        f"{case}: losses {diff:.3g} apart, beyond the bound for reordered fp32 arithmetic ({bound:.3g}: loss "
        f"{loss:.3g}, steps={steps}; tests/tolerances.py)"
    )


#: The design's bar for fp32 training against plain single-process PyTorch (``DESIGN.md``).
DESIGN_FP32 = 1e-5


def assert_as_reference(case: str, result: dict, precision: str) -> None:
    """``result["diff"]``, a run's weights against its reference: for ``"32-true"`` plain PyTorch, within the
    design's bar; for a mixed precision the single-process emulation of our arithmetic (``mixed_reference.py``),
    which sums in our order but on tensors of its own, whose fp32 sums may take other kernels: reordered fp32."""
    if precision == "32-true":
        assert result["diff"] <= DESIGN_FP32, f"{case}: {result['diff']:.3g} from plain PyTorch, beyond {DESIGN_FP32:g}"
    else:
        assert_reordered_fp32(case, result["diff"], result["lr"], result["steps"])
