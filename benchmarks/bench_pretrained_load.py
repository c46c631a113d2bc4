"""Peak host memory per rank of loading pretrained weights into a meta-initialised ZeRO-3 run.

    python benchmarks/bench_pretrained_load.py            # GPT-2 124M (n_embd 768, 12 layers)

Saves a GPT-2 of the default size with ``save_pretrained`` once (random weights stand in for downloaded
ones), then starts 2 CPU ranks twice: ``configure_model`` builds ``GPT2LMHeadModel`` on the meta device under
``ZeroStrategy(stage=3)``, once without and once with ``init_weights=DIR``. Each rank records its peak
resident memory (``VmHWM``) above its resident memory before the model is built, up to the first batch.
The difference between the runs is what the load costs; it is printed against the model's full fp32 size
and one rank's sharded size (JSON lines, then a table).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rank_main(weights: str, init: bool, report: str) -> None:
    import lightning as L
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from lightning_zero import ZeroStrategy

    class Probe(L.Callback):
        def setup(self, trainer, pl_module, stage):
            self.before = status_kib("VmRSS")

        def on_fit_start(self, trainer, pl_module):
            peak = status_kib("VmHWM") - self.before
            params = sum(p.numel() for p in pl_module.parameters())
            rows = [peak, params]
            gathered = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, rows)
            if trainer.is_global_zero:
                Path(report).write_text(json.dumps({"peak_kib": [g[0] for g in gathered], "params": params}))
            trainer.should_stop = True

    class Module(L.LightningModule):
        def configure_model(self):
            if not hasattr(self, "model"):
                self.model = GPT2LMHeadModel(GPT2Config.from_pretrained(weights))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0]).logits.float().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    strategy = ZeroStrategy(stage=3, init_weights=weights if init else None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Probe()],
    )
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(4, 8, dtype=torch.long)), batch_size=2
    )
    trainer.fit(Module(), data)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3] == "1", sys.argv[4])
        return
    from transformers import GPT2Config, GPT2LMHeadModel

    tmp = Path(tempfile.mkdtemp(prefix="lz-pretrained-"))
    weights = tmp / "gpt2"
    GPT2LMHeadModel(GPT2Config()).save_pretrained(weights)
    file_mib = sum(f.stat().st_size for f in weights.iterdir()) / 2**20
    rows = {}
    for init in (False, True):
        report = tmp / f"report{int(init)}.json"
        subprocess.run(
            [sys.executable, __file__, "--rank", str(weights), str(int(init)), str(report)],
            check=True,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        rows[init] = json.loads(report.read_text())
    params = rows[True]["params"]
    full, shard = params * 4 / 2**20, params * 4 / 2 / 2**20
    for rank in range(2):
        without, with_load = (rows[i]["peak_kib"][rank] / 1024 for i in (False, True))
        line = {
            "rank": rank,
            "params": params,
            "file_mib": round(file_mib, 1),
            "full_fp32_mib": round(full, 1),
            "shard_mib": round(shard, 1),
            "peak_growth_no_load_mib": round(without, 1),
            "peak_growth_with_load_mib": round(with_load, 1),
            "load_cost_mib": round(with_load - without, 1),
        }
        print(json.dumps(line))
    print(f"\nGPT-2 {params / 1e6:.1f}M parameters: full fp32 {full:.0f} MiB, one rank's shard {shard:.0f} MiB")
    print("rank | peak RSS growth, meta init only | with init_weights | load's cost")
    for rank in range(2):
        without, with_load = (rows[i]["peak_kib"][rank] / 1024 for i in (False, True))
        print(f"{rank:4d} | {without:30.0f} | {with_load:16.0f} | {with_load - without:11.0f} MiB")


if __name__ == "__main__":
    main()
