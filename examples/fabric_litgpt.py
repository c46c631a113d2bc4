"""Pretrain a LitGPT model in a Lightning Fabric loop with ZeRO, written the way LitGPT's ``pretrain`` writes its loop.

    python examples/fabric_litgpt.py                              # ZeRO-3 on 2 CPU processes, 60 steps
    python examples/fabric_litgpt.py --strategy zero2_offload --max-steps 100
    python examples/fabric_litgpt.py --max-steps 120              # run again: resumes from out/fabric_litgpt/latest

Nothing is downloaded: a tiny ``litgpt.Config`` and a synthetic corpus (a few token patterns the model learns to
continue). What a LitGPT user changes is one line, ``strategy=FSDPStrategy(...)`` -> ``strategy="zero3"``
(docs/fabric.md):

* ``fabric.init_module(empty_init=True)`` builds the model on the meta device at stage 3; LitGPT's
  ``initialize_weights`` then names each layer's initialiser and sharding runs them one unit at a time;
* 4 micro-batches accumulate under ``fabric.no_backward_sync`` (no gradient traffic until the last);
* ``fabric.clip_gradients(max_norm=1.0)`` clips by the global norm over every rank's shards;
* ``fabric.save`` writes a sharded checkpoint every ``--save-every`` steps (the same format a ``Trainer`` with
  ``lightning_zero.ZeroStrategy`` writes and resumes from), and the next run continues from the newest one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

import lightning as L  # noqa: E402
import torch  # noqa: E402
from litgpt import GPT, Config  # noqa: E402
from litgpt.pretrain import initialize_weights  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_zero  # noqa: E402, F401 - registers "zero1" / "zero2" / "zero3" (and variants) with Fabric


class Patterns(Dataset):
    """Rows of ``block_size + 1`` tokens, each continuing one of a few fixed patterns from a random offset."""

    def __init__(self, vocab_size: int, block_size: int, rows: int = 512, patterns: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.patterns = torch.randint(0, vocab_size, (patterns, 64), generator=generator)  # (P, 64)
        self.choice = torch.randint(0, patterns, (rows,), generator=generator)
        self.offset = torch.randint(0, 64, (rows,), generator=generator)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.choice)

    def __getitem__(self, i: int) -> torch.Tensor:
        positions = (self.offset[i] + torch.arange(self.block_size + 1)) % 64
        return self.patterns[self.choice[i], positions]  # (T + 1,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="zero3", help="a lightning_zero name: zero1, zero2, zero3, zero2_offload")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=60, help="optimizer steps in all, a resumed run's included")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch and rank")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("out/fabric_litgpt"))
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(1337)
    config = Config(
        n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=128, padded_vocab_size=128, rotary_percentage=1.0
    )
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    loader = fabric.setup_dataloaders(
        DataLoader(Patterns(config.vocab_size, config.block_size), batch_size=args.micro_batch, shuffle=True)
    )
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    latest = args.out / "latest"
    if latest.exists():
        fabric.load(latest, state)
        fabric.print(f"resumed from step {state['step_count']}")

    losses: list[float] = []
    epoch = 0
    while state["step_count"] < args.max_steps:
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            state["iter_num"] += 1
            accumulating = state["iter_num"] % args.accumulate != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                logits = model(batch[:, :-1])  # (B, T, V)
                loss = chunked_cross_entropy(logits, batch[:, 1:])
                fabric.backward(loss / args.accumulate)
            if accumulating:
                continue
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
            losses.append(float(fabric.all_reduce(loss.detach())))
            if state["step_count"] % args.save_every == 0:
                fabric.save(latest, state)
            if state["step_count"] >= args.max_steps:
                break
        epoch += 1
    if losses:
        last = sum(losses[-5:]) / len(losses[-5:])
        fabric.print(f"loss {losses[0]:.4f} -> {last:.4f} ({len(losses)} steps, {args.strategy})")


if __name__ == "__main__":
    main()
