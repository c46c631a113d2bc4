"""Corruption fuzz: random damage to every file of a small sharded checkpoint, through every reader.

One process, no process group (verify, load and consolidate all work at world size 1). Each seeded case
damages one file of a good checkpoint (bytes flipped, truncated, extended, a block zeroed), then runs
``inspect_checkpoint(verify=True)`` (what ``lightning-zero verify`` prints), ``checkpoint_io.load`` (what
``Trainer.fit(ckpt_path=...)`` runs on each rank) and ``consolidate``. Every reader must end in a
``CheckpointError`` that names the damaged file, never another exception, a hang (each case runs under an
alarm) or a load of different values. The one damage that may load is one that changes nothing a reader
reads (say, whitespace in manifest.json turned into other whitespace): then the load must be identical.
"""

from __future__ import annotations

import collections
import json
import random
import signal
import warnings
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import io as checkpoint_io
from lightning_zero.checkpoint import state_dicts
from lightning_zero.checkpoint.consolidate import consolidate
from lightning_zero.checkpoint.listing import inspect_checkpoint
from lightning_zero.checkpoint.verify import CheckpointError, describe_files, read_manifest, write_manifest
from lightning_zero.checkpoint.write import save_sharded
from tests.distributed import models

SEED = 18
CASES_PER_FILE = 60
FILES = ("manifest.json", ".metadata", "meta.pt", "__0_0.distcp")
DAMAGES = ("flip1", "flip8", "truncate", "extend", "zero_block")
SECONDS_PER_CASE = 20


def _module_and_optimizer(seed: int):
    torch.manual_seed(seed)
    module = models.Regression()
    optimizer, _ = models.make_optimizer(module)
    for p in module.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates exp_avg / exp_avg_sq / step
    return module, optimizer


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A sharded checkpoint written by the library's own writer, as a 1-rank run writes it."""
    path = tmp_path_factory.mktemp("fuzz") / "good.ckpt"
    module, optimizer = _module_and_optimizer(0)
    checkpoint = {
        "state_dict": state_dicts.sharded_model_state(module, None),
        "optimizer_states": [state_dicts.sharded_optimizer_state(optimizer, module, None)],
        "global_step": 3,
        "epoch": 0,
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 1, "completed": 0}}}},
        "lr_schedulers": [{"step_size": 2, "gamma": 0.5, "base_lrs": [0.01, 0.01], "last_epoch": 3}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "assuming the intent is to save in a single process"
        save_sharded(checkpoint, path)
    return path


def _load(path: Path) -> tuple[dict, dict, dict]:
    module, optimizer = _module_and_optimizer(1)  # different values: a silent partial load would show
    meta = checkpoint_io.load(path, module, [optimizer], None)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    optim = {f"{i}.{k}": v for i, entry in optimizer.state_dict()["state"].items() for k, v in entry.items()}
    return state, optim, {k: v for k, v in meta.items() if k in ("global_step", "optimizer_param_groups")}


def _damage(data: bytes, how: str, rng: random.Random) -> bytes:
    out = bytearray(data)
    if how.startswith("flip"):
        for _ in range(int(how[4:])):
            out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
    elif how == "truncate":
        out = out[: rng.randrange(len(out))]
    elif how == "extend":
        out += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 65)))
    else:  # a block of zeros, as a failed disk sector reads back
        start = rng.randrange(len(out))
        out[start : start + 512] = bytes(len(out[start : start + 512]))
    return bytes(out)


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _outcome(run, file: str, same_as_good, names=()) -> str:
    """``named`` (CheckpointError naming ``file``, or one of ``names``), ``identical`` (loaded, equal to the
    good checkpoint), or a failure: ``unnamed``, ``crash:<type>``, ``hang``, ``silent``."""
    signal.alarm(SECONDS_PER_CASE)
    try:
        result = run()
    except CheckpointError as err:
        return "named" if any(name in str(err) for name in (file, *names)) else f"unnamed: {err}"
    except _Hang:
        return "hang"
    except BaseException as err:  # the fuzz records what escaped (DCP's CheckpointException is a BaseException)
        return f"crash:{type(err).__name__}: {err}"
    finally:
        signal.alarm(0)
    return "identical" if same_as_good(result) else "silent"


def test_every_damaged_file_is_named_by_every_reader(good, tmp_path):
    rng = random.Random(SEED)
    reference = _load(good)
    previous = signal.signal(signal.SIGALRM, _alarm)
    outcomes: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    try:
        for file in FILES:
            original = (good / file).read_bytes()
            for case in range(CASES_PER_FILE):
                how = DAMAGES[case % len(DAMAGES)]
                damaged = _damage(original, how, rng)
                (good / file).write_bytes(damaged)
                out = tmp_path / "out.pt"
                results = {
                    "verify": _outcome(lambda: _verify(good), file, lambda entry: entry.complete),
                    "load": _outcome(lambda: _load(good), file, lambda loaded: _equal(loaded, reference)),
                    "consolidate": _outcome(lambda: consolidate(good, out), file, lambda written: written.exists()),
                }
                if results["verify"] == "identical":  # "complete": only right if nothing a reader reads changed
                    results["verify"] = "identical" if results["load"] == "identical" else "silent"
                if results["verify"] != "identical" and (out.exists() or list(tmp_path.glob(".out.pt.tmp-*"))):
                    results["consolidate"] = "left output behind"
                out.unlink(missing_ok=True)
                for reader, result in results.items():
                    outcomes[(file, reader)][result.split(":")[0]] += 1
                    if result not in ("named", "identical"):
                        failures.append(f"{file} {how} case {case} {reader}: {result}")
            (good / file).write_bytes(original)
    finally:
        signal.signal(signal.SIGALRM, previous)
    summary = {f"{file} / {reader}": dict(counter) for (file, reader), counter in sorted(outcomes.items())}
    print(json.dumps({"cases": len(FILES) * CASES_PER_FILE, "seed": SEED, "outcomes": summary}, indent=1))
    assert not failures, "\n".join(failures[:20])
    assert len(FILES) * CASES_PER_FILE >= 200
    assert inspect_checkpoint(good, verify=True).status == "complete"  # the original is restored


def _verify(path: Path):
    """``inspect_checkpoint`` reports rather than raises: its problem text is what ``verify`` prints."""
    entry = inspect_checkpoint(path, verify=True)
    if entry.status != "complete":
        raise CheckpointError(f"{entry.status}: {entry.problem}")
    return entry


def _equal(loaded, reference) -> bool:
    (state, optim, meta), (ref_state, ref_optim, ref_meta) = loaded, reference
    same = lambda a, b: a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    return same(state, ref_state) and same(optim, ref_optim) and meta == ref_meta


@pytest.mark.full
def test_damage_behind_a_matching_manifest_still_ends_in_a_checkpoint_error(good, tmp_path):
    """The same damage with manifest.json rewritten to match (as a buggy writer, or anyone who can write the
    directory, would): checksums cannot tell, so a load may succeed, but the parsers behind them must still
    end in a CheckpointError naming the file or the checkpoint, never another exception or a hang."""
    rng = random.Random(SEED + 1)
    manifest = read_manifest(good)
    previous = signal.signal(signal.SIGALRM, _alarm)
    outcomes: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    failures = []
    try:
        for file in (".metadata", "meta.pt", "__0_0.distcp"):
            original = (good / file).read_bytes()
            for case in range(CASES_PER_FILE):
                how = DAMAGES[case % len(DAMAGES)]
                (good / file).write_bytes(_damage(original, how, rng))
                write_manifest(good, {**manifest, **describe_files(good, [file])})
                out = tmp_path / "out.pt"
                for reader, run in (
                    ("verify", lambda: _verify(good)),
                    ("load", lambda: _load(good)),
                    ("consolidate", lambda: consolidate(good, out)),
                ):
                    result = _outcome(run, file, lambda _: True, names=(str(good),)).replace("identical", "loaded")
                    outcomes[(file, reader)][result.split(":")[0]] += 1
                    if result not in ("named", "loaded"):
                        failures.append(f"{file} {how} case {case} {reader}: {result}")
                out.unlink(missing_ok=True)
            (good / file).write_bytes(original)
            write_manifest(good, manifest)
    finally:
        signal.signal(signal.SIGALRM, previous)
    summary = {f"{file} / {reader}": dict(counter) for (file, reader), counter in sorted(outcomes.items())}
    print(json.dumps({"cases": 3 * CASES_PER_FILE, "seed": SEED + 1, "outcomes": summary}, indent=1))
    assert not failures, "\n".join(failures[:20])
