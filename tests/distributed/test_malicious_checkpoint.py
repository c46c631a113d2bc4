"""A crafted checkpoint never runs code: every load path refuses the payload and names the file.

An attacker with write access to a shared checkpoint directory replaces a file with a pickle whose
``__reduce__`` calls ``os.system`` and updates the manifest (a checksum, not a signature). ``Trainer.fit/
validate/test/predict(ckpt_path=...)`` on 2 ranks, ``init_weights``, ``lightning-zero consolidate`` and
``lightning-zero verify`` must refuse it; the marker file the payload would
create must not exist afterwards.
"""

import pytest

from lightning_zero.cli import main as cli_main
from tests.launch import launch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    directory = tmp_path_factory.mktemp("evil")
    report = launch("tests.distributed.worker_checkpoint", "malicious", nprocs=2, env={"LZ_SHARED_DIR": str(directory)})
    return {**report, "dir": directory}


@pytest.mark.parametrize(
    ("case", "names"),
    [("metadata", [".metadata", "posix.system"]), ("meta", ["meta.pt", "system"]), ("full", ["evil_full", "system"])],
)
def test_fit_with_ckpt_path_refuses_the_payload(shared, case, names, record_property):
    result = shared["malicious"][case]
    record_property("refused with", result["error"])
    assert result["error"] == "UnsafeCheckpointError", result
    for name in names:
        assert name in result["message"], result["message"]
    assert not result["ran"], "the payload ran"


@pytest.mark.parametrize("entry", ["validate", "test", "predict"])
@pytest.mark.parametrize(("case", "name"), [("metadata", ".metadata"), ("meta", "meta.pt")])
def test_evaluation_with_ckpt_path_refuses_the_payload(shared, entry, case, name):
    result = shared["malicious"][f"{entry}_{case}"]
    assert result["error"] == "UnsafeCheckpointError", result
    assert name in result["message"], result["message"]
    assert not result["ran"], "the payload ran"


@pytest.mark.parametrize(("entry", "name"), [("init_weights", "evil_full"), ("init_weights_sharded", "evil_metadata")])
def test_init_weights_refuses_the_payload(shared, entry, name):
    """A file, and a sharded directory whose ``.metadata`` carries the payload."""
    result = shared["malicious"][entry]
    assert result["error"] == "UnsafeCheckpointError", result
    assert name in result["message"], result["message"]
    assert not result["ran"], "the payload ran"


@pytest.mark.parametrize("case", ["metadata", "meta"])
def test_verify_reports_the_payload_as_corrupted(shared, case, capsys):
    """`lightning-zero verify` in this process: a payload that ran would leave its marker here too."""
    directory = shared["dir"]
    assert cli_main(["verify", str(directory / f"evil_{case}")]) == 1
    out = capsys.readouterr().out
    assert "corrupted" in out and "Refused to read" in out, out
    assert not (directory / f"PWNED_{case}").exists()


@pytest.mark.parametrize("case", ["metadata", "meta"])
def test_consolidate_refuses_the_payload(shared, case, tmp_path, capsys):
    directory = shared["dir"]
    assert cli_main(["consolidate", str(directory / f"evil_{case}"), str(tmp_path / "model.pt")]) == 2
    err = capsys.readouterr().err
    assert "Refused to read" in err and "nothing in" in err
    assert not (directory / f"PWNED_{case}").exists()
    assert not (tmp_path / "model.pt").exists()


def test_the_untampered_checkpoint_still_consolidates(shared, tmp_path):
    assert cli_main(["consolidate", str(shared["dir"] / "good"), str(tmp_path / "model.pt")]) == 0
