"""A Fabric script launched as ``fabric.launch(fn)`` with ``start_method="spawn"`` (Fabric's ``ddp_spawn`` way), for
tests/integration/test_fabric_launch.py: ``python -m tests.integration.fabric_spawned trains|fails OUT``.

``trains``: 3 steps of the demo GPT at stage 3, rank 0's result (what ``launch`` returns) written to OUT as JSON.
``fails``: the first step trains, then rank 1 raises inside the second; rank 0 must stop naming rank 1's error.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.nn.functional as F

from lightning_zero.demo import GPTLightningModule
from lightning_zero.fabric import ZeroStrategy


def loop(fabric: L.Fabric, fail: bool) -> dict:
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        module = GPTLightningModule(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(fabric.global_rank))
    losses = []
    for step in range(3):
        if fail and step == 1 and fabric.global_rank == 1:
            raise RuntimeError("rank 1's batch could not be read")
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(fabric.all_reduce(loss.detach())))
        fabric.print(f"step {step} loss {losses[-1]:.4f}", flush=True)  # before rank 1's failure ends this process
    return {"losses": losses, "world_size": fabric.world_size, "stage": fabric.strategy.stage}


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ZeroStrategy(stage=3, start_method="spawn", timeout=20))
    result = fabric.launch(loop, mode == "fails")
    with open(out, "w") as file:
        json.dump(result, file)
