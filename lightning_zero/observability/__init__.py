"""What a run shows of itself: ``ZeroMonitor``'s per-step figures in the Trainer's logs (``monitor.py``) and the
gradient norms of the full, averaged gradients, as Lightning's ``grad_norm`` reports them (``gradient_norms.py``)."""

from lightning_zero.observability.gradient_norms import grad_norm
from lightning_zero.observability.monitor import ZeroMonitor

__all__ = ["ZeroMonitor", "grad_norm"]
