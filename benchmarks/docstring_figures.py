"""Three figures that sat in docstrings, measured again: the flight recorder's cost per collective, the safe DCP
metadata reader against pickle's C unpickler, and the demo's character dataset build.

    python benchmarks/docstring_figures.py
"""

import io
import pickle
import tempfile
import time
import timeit

import torch
import torch.distributed.checkpoint as dcp

from lightning_zero.checkpoint.safe_load import MetadataUnpickler
from lightning_zero.demo.data import GrammarGenerator
from lightning_zero.engine.comm.flight import FlightRecorder

rec = FlightRecorder()
n = 200_000
t = timeit.timeit(lambda: rec.done(rec.issue("all_gather", 1024, torch.float32)), number=n)
print(f"flight recorder issue+done: {t / n * 1e6:.2f} us per collective ({n} calls)")

with tempfile.TemporaryDirectory() as d:
    state = {f"layer{i}.weight": torch.zeros(8, 8) for i in range(2000)}
    dcp.save(state, checkpoint_id=d, no_dist=True)
    raw = open(f"{d}/.metadata", "rb").read()
    c = min(timeit.repeat(lambda: pickle.loads(raw), number=5, repeat=5)) / 5
    py = min(timeit.repeat(lambda: MetadataUnpickler(io.BytesIO(raw), f"{d}/.metadata").load(), number=5, repeat=5)) / 5
    print(
        f"DCP .metadata of 2000 tensors ({len(raw)} bytes): C unpickler {c * 1e3:.1f} ms, safe Python unpickler {py * 1e3:.1f} ms ({py / c:.1f}x)"
    )

start = time.perf_counter()
GrammarGenerator(0).text(200_000)
print(f"demo corpus, 200k characters: {time.perf_counter() - start:.3f} s")
