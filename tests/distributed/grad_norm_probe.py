"""A probe of ``lightning_zero.grad_norm`` against the norms of the gathered gradients, shared by the workers of
the hybrid and pipeline tests."""

from __future__ import annotations

import lightning as L


class GradNormAgainstGathered(L.Callback):
    """Each step, ``lightning_zero.grad_norm`` of the whole module (2-norm and infinity norm) against the norms of
    the full gradients ``gather_gradients`` assembles: the largest relative difference, and how many norms were
    compared (every parameter with a gradient, on every rank, whatever stage, replicas or pipeline stage holds it).
    Also called from ``on_after_backward`` and ``on_train_batch_end``: refused in a micro-batch that accumulates,
    the step's norms in its last."""

    def __init__(self) -> None:
        self.worst, self.compared, self.keys_match = 0.0, 0, True
        #: From ``on_after_backward``: refusals (a micro-batch that accumulates), and the norms of a step's last one.
        self.refusals: list[str] = []
        self.after_backward: dict[str, float] | None = None
        self.after_backward_matches = True
        self.batch_end_refusals: list[str] = []

    def on_after_backward(self, trainer, pl_module):
        from lightning_zero import grad_norm

        try:
            self.after_backward = {k: float(v) for k, v in grad_norm(pl_module, 2.0).items()}
        except RuntimeError as error:
            self.refusals.append(str(error))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        from lightning_zero import grad_norm

        try:  # after a micro-batch that accumulates: refused too; after a step: whatever the step left, changed nothing
            grad_norm(pl_module, 2.0)
        except RuntimeError as error:
            self.batch_end_refusals.append(str(error))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        from lightning_zero import grad_norm

        if self.after_backward is not None:
            self.after_backward_matches &= self.after_backward == {
                k: float(v) for k, v in grad_norm(pl_module, 2.0).items()
            }
            self.after_backward = None
        full = trainer.strategy.gather_gradients()
        for norm_type in (2.0, float("inf")):
            ours = grad_norm(pl_module, norm_type)
            self.keys_match &= set(ours) == {f"grad_{norm_type}_norm/{name}" for name in full} | {
                f"grad_{norm_type}_norm_total"
            }
            for name, grad in full.items():
                expected = float(grad.float().norm(norm_type))
                got = float(ours.get(f"grad_{norm_type}_norm/{name}", float("nan")))
                self.worst = max(
                    self.worst, abs(got - expected) / max(expected, 1e-12), 0.0 if got == got else float("inf")
                )
                self.compared += 1

    @staticmethod
    def check(result: dict, steps: int, accumulate: int) -> None:
        """The test side: every norm compared and equal, a refusal in each micro-batch that accumulates."""
        assert result["keys_match"] and result["compared"] > 0, result
        assert result["worst_relative"] <= 1e-6, result
        assert len(result["refusals"]) == steps * (accumulate - 1)
        assert all("Call it where the step's gradients are final" in refusal for refusal in result["refusals"])
        assert result["after_backward_matches"]  # a step's last micro-batch: the norms on_before_optimizer_step sees
        assert len(result["batch_end_refusals"]) == steps * (accumulate - 1)

    def report(self) -> dict:
        return {
            "worst_relative": self.worst,
            "compared": self.compared,
            "keys_match": self.keys_match,
            "refusals": self.refusals,
            "after_backward_matches": self.after_backward_matches,
            "batch_end_refusals": self.batch_end_refusals,
        }
