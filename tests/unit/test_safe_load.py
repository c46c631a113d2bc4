"""Checkpoint readers that never execute code (no processes: DCP with ``no_dist``)."""

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_zero.checkpoint.io import load
from lightning_zero.checkpoint.safe_load import UnsafeCheckpointError, dcp_load, load_weights_only, read_dcp_metadata
from lightning_zero.checkpoint.verify import CheckpointError
from tests.distributed.malicious import RunsShell


def test_dcp_metadata_and_bytes_entries_round_trip(tmp_path):
    state = {"w": torch.randn(3, 4), "extra": {"n": 5, "s": "x", "l": [1, 2.0]}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    assert set(read_dcp_metadata(tmp_path / ".metadata").state_dict_metadata) == {"w", "extra.n", "extra.s", "extra.l"}
    target = {"w": torch.zeros(3, 4), "extra": {"n": 0, "s": "", "l": []}}
    dcp_load(target, tmp_path, no_dist=True)
    assert torch.equal(target["w"], state["w"]) and target["extra"] == state["extra"]


def test_a_pickle_payload_in_dcp_metadata_is_refused(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    marker = tmp_path / "PWNED"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsShell(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*posix\.system"):
        read_dcp_metadata(tmp_path / ".metadata")
    with pytest.raises(UnsafeCheckpointError):
        dcp_load({"w": torch.zeros(2)}, tmp_path, no_dist=True)
    assert not marker.exists()


def test_a_pickle_payload_in_a_shard_entry_is_refused(tmp_path):
    """DCP stores non-tensor entries as torch.save blobs and its default planner loads them unrestricted."""
    marker = tmp_path / "PWNED"
    dcp.save({"w": torch.ones(2), "extra": RunsShell(marker)}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(UnsafeCheckpointError, match="entry 'extra'"):
        dcp_load({"w": torch.zeros(2), "extra": None}, tmp_path, no_dist=True)
    assert not marker.exists()


def test_garbage_metadata_names_the_file(tmp_path):
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_dcp_metadata(tmp_path / ".metadata")


def test_torch_files_load_weights_only_and_weights_only_false_is_refused(tmp_path):
    marker = tmp_path / "PWNED"
    torch.save({"state_dict": {}, "x": RunsShell(marker)}, tmp_path / "evil.ckpt")
    with pytest.raises(UnsafeCheckpointError, match="evil.ckpt.*posix.system"):
        load_weights_only(tmp_path / "evil.ckpt")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load(tmp_path / "evil.ckpt", None, [], None, weights_only=False)
    assert not marker.exists()
    torch.save({"state_dict": {"w": torch.ones(1)}}, tmp_path / "ok.ckpt")
    assert load(tmp_path / "ok.ckpt", None, [], None)["state_dict"]["w"].item() == 1.0
