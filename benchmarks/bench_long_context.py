"""Peak bytes per rank of a Llama-style model at growing sequence lengths, under each long-sequence setting, measured
on 2 CPU ranks inside ``lightning.Trainer`` with the planner's prediction beside each figure.

    python benchmarks/bench_long_context.py                                   # 512 .. 4096 positions
    python benchmarks/bench_long_context.py --lengths 1024,2048 --budget 256MiB --json long_context.json
    python benchmarks/bench_long_context.py --model hidden_size=256,intermediate_size=1024,num_hidden_layers=8,vocab_size=2048

Each row is one ``fit`` of 2 optimizer steps at ZeRO stage 2, one sequence per rank and micro-batch, measured by the
planner's ``PeakMemory`` (the second step's peak of live tensor bytes per rank, model state included: on a CPU there
is no allocator statistic). On a CPU the host is the device, so offloaded activations are counted the way a GPU run
would hold them: their host copies are made outside the tracker ([Note: offloaded checkpoint inputs]) and their bytes
moved are printed beside. The modes: ``checkpointing`` (each decoder layer), ``+offload`` (its inputs on the host),
``+tiles`` (checkpointing and ``tiled_compute=True``: the MLPs in tiles of the hidden size's positions, the head and
the loss in tiles of 2**24 logits), ``all`` (the three), ``+sp2`` (checkpointing and ``sequence_parallel_size=2``: the
2 ranks share each sequence, each holding half of it) and ``all+sp2``. Without sequence parallelism each rank trains
its own sequence; with it both ranks train the same one (the data-parallel degree is 1). The planner's prediction is
``Planner.candidate`` of the same run (its trace runs the same settings under fake tensors), and the last table is the
longest of the lengths run that each mode fits in ``--budget`` per rank, measured and predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = {
    "checkpointing": {},
    "+offload": {"offload_activations": True},
    "+tiles": {"tiled_compute": True},
    "all": {"offload_activations": True, "tiled_compute": True},
    "+sp2": {"sequence_parallel_size": 2},
    "all+sp2": {"offload_activations": True, "tiled_compute": True, "sequence_parallel_size": 2},
}
MODEL = dict(
    vocab_size=16384,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    initializer_range=0.02,
)


def _model_settings() -> dict:
    """:data:`MODEL` with the ``--model`` overrides, which the rank processes read from the environment."""
    return {**MODEL, **json.loads(os.environ.get("LZ_BENCH_MODEL", "{}"))}


def _module(length: int) -> Any:
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class CausalLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(**_model_settings(), max_position_embeddings=length))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return CausalLM()


def _batch(length: int, size: int = 1):
    import torch

    tokens = torch.randint(
        0, _model_settings()["vocab_size"], (size, length), generator=torch.Generator().manual_seed(0)
    )
    return (tokens,)


def run_rank(length: int, mode: str, out: Path) -> None:
    """One rank of one measured ``fit`` (launched by Lightning's popen launcher from :func:`measure`)."""
    import lightning as L
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_zero import ZeroStrategy
    from lightning_zero.planning.measure import PeakMemory

    torch.set_num_threads(1)
    L.seed_everything(0)
    module = _module(length)
    data = torch.utils.data.DataLoader([(_batch(length)[0][0],) for _ in range(8)], batch_size=1)
    peak = PeakMemory()
    strategy = ZeroStrategy(stage=2, activation_checkpointing=LlamaDecoderLayer, **MODES[mode])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[peak],
    )
    started = time.perf_counter()
    trainer.fit(module, data)
    offload = trainer.strategy.activation_offload
    if trainer.global_rank == 0:
        out.write_text(
            json.dumps(
                {
                    "peaks": peak.peaks,
                    "offloaded_bytes": offload.statistics.offloaded_bytes if offload is not None else 0,
                    "seconds": time.perf_counter() - started,
                }
            )
        )


def measure(length: int, mode: str) -> dict:
    out = Path(f"/tmp/bench_long_context_{os.getpid()}_{length}_{mode.strip('+')}.json")
    command = [sys.executable, __file__, "--rank-of", str(length), mode, str(out)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(out.read_text())
    out.unlink()
    return result


def predict(length: int, mode: str) -> float:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from lightning_zero.planning import Configuration, Planner

    settings = MODES[mode]
    planner = Planner(
        lambda: _module(length),
        _batch(length),
        world_size=2,
        checkpointing=LlamaDecoderLayer,
        backend="gloo",
        tiled_compute=settings.get("tiled_compute", False),
        sequence_parallel_size=settings.get("sequence_parallel_size", 1),
    )
    return planner.candidate(
        Configuration(2), True, 1, settings.get("offload_activations", False)
    ).prediction.device_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--budget", default="256MiB", help="per rank, for the longest-length table")
    parser.add_argument("--model", default="", help="LlamaConfig overrides, e.g. hidden_size=256,num_hidden_layers=8")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--rank-of", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        length, mode, out = args.rank_of
        run_rank(int(length), mode, Path(out))
        return
    from lightning_zero.planning.formulas import parse_bytes

    overrides = dict(item.split("=") for item in args.model.split(",") if item)
    os.environ["LZ_BENCH_MODEL"] = json.dumps({k: int(v) for k, v in overrides.items()})
    print(f"model: LlamaConfig({_model_settings()}), stage 2, 2 CPU ranks, 1 sequence per rank")
    lengths = [int(v) for v in args.lengths.split(",")]
    modes = args.modes.split(",")
    rows = []
    mib = 2**20
    print(f"{'length':>7} {'mode':>14} {'measured MiB':>13} {'predicted MiB':>14} {'error':>7} {'offloaded MiB':>14}")
    for length in lengths:
        for mode in modes:
            result = measure(length, mode)
            measured = max(result["peaks"])
            predicted = predict(length, mode)
            rows.append({"length": length, "mode": mode, "measured": measured, "predicted": predicted, **result})
            print(
                f"{length:>7} {mode:>14} {measured / mib:>13.1f} {predicted / mib:>14.1f} "
                f"{(predicted - measured) / measured:>+7.1%} {result['offloaded_bytes'] / mib:>14.1f}",
                flush=True,
            )
    budget = parse_bytes(args.budget)
    longest = {}
    print(f"\nlongest length within {args.budget} per rank (measured / predicted):")
    for mode in modes:
        measured = [r["length"] for r in rows if r["mode"] == mode and r["measured"] <= budget]
        predicted = [r["length"] for r in rows if r["mode"] == mode and r["predicted"] <= budget]
        longest[mode] = (max(measured, default=None), max(predicted, default=None))
        print(f"{mode:>14} {longest[mode][0]} / {longest[mode][1]}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "budget": budget, "longest": longest}, indent=1))


if __name__ == "__main__":
    main()
