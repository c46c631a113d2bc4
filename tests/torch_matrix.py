"""``make test-torch``: the distributed cases under every torch release ``setup.cfg`` admits, each in a venv of its own.

For each entry of :data:`MATRIX` a venv under ``$LZ_TORCH_VENVS`` (default ``~/.cache/lightning_zero/torch-venvs``) gets
that torch (pinned first, so pip never resolves another), then this package editable with its test extra and the
Lightning (and transformers) of the entry; a venv whose record matches is reused, so only the first run pays for the
install. Then the cases of :data:`CASES` run under it (stages 1-3 against plain PyTorch and the memory formulas,
offload, pipeline x ZeRO-3 with every schedule, the planner's trace, the safe loader's refusals, Hugging Face models,
the adapters' own tests), and a checkpoint written under the oldest torch is resumed under the newest and the other
way (``tests/distributed/worker_torch_versions.py``). Prints each version's cases with the figures they record
(``record_property``), the venvs' build times, and exits non-zero if anything failed.

    python tests/torch_matrix.py                     # every entry
    python tests/torch_matrix.py --only 2.11.0       # one entry (and no cross-version resume)
"""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.distributed.test_torch_versions import check_resumed  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Entry:
    torch: str
    lightning: str
    #: None: the newest the registry has; a version: the floor ``setup.cfg`` states for it.
    transformers: str | None = None

    @property
    def name(self) -> str:
        extra = f"-transformers{self.transformers}" if self.transformers else ""
        return f"torch{self.torch}-lightning{self.lightning}{extra}"


#: Oldest torch first, the newest last. torch 2.13 with Lightning 2.6.6 and the newest transformers is ``make test``'s
#: own; here it runs with the oldest Lightning and transformers admitted. torch 2.11 with Lightning 2.6.6 is the GPU
#: image's.
MATRIX = (
    Entry("2.11.0", "2.6.6"),
    Entry("2.12.1", "2.6.6"),
    Entry("2.13.0", "2.5.6", "4.57.6"),
    Entry("2.14.1", "2.6.6"),
)

#: What runs under each release (``-m "not full"``): the cases the torch-versions issue names, and the adapters'.
CASES = (
    "tests/unit/test_torch_versions.py",
    "tests/unit/test_fsdp2_private.py",
    "tests/distributed/test_core.py::test_parameters_and_gradients_match_plain_pytorch",
    "tests/distributed/test_core.py::test_model_state_bytes_after_backward_match_zero_formulas",
    "tests/distributed/test_offload.py",
    "tests/distributed/test_edges.py",
    "tests/distributed/test_pipeline_trainer.py",
    "tests/distributed/test_planning.py",
    "tests/distributed/test_malicious_checkpoint.py",
    "tests/distributed/test_hf_models.py",
    "tests/distributed/test_precision_zoo.py",
    "tests/distributed/test_torch_versions.py",
    "tests/integration/test_type_check.py",  # mypy on each release's stubs
)


def venv_root() -> Path:
    return Path(os.environ.get("LZ_TORCH_VENVS", Path.home() / ".cache" / "lightning_zero" / "torch-venvs"))


def _requirements_key(entry: Entry) -> str:
    """What a venv was built from: the entry and ``setup.cfg``'s requirements (a changed dependency rebuilds it)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    requirements = config["options"]["install_requires"] + config["options.extras_require"]["test"]
    return f"{entry.name}-{hashlib.sha256(requirements.encode()).hexdigest()[:16]}"


def ensure_venv(entry: Entry) -> tuple[Path, str, float]:
    """The entry's venv, built if missing or stale: (python, "built" or "cached", seconds it took)."""
    where = venv_root() / entry.name
    record = where / "lightning_zero-venv.json"
    start = time.perf_counter()
    if record.exists() and json.loads(record.read_text()).get("key") == _requirements_key(entry):
        python = where / "bin" / "python"
        subprocess.run([str(python), "-c", "import torch, lightning, lightning_zero"], check=True, cwd=REPO)
        return python, "cached", time.perf_counter() - start
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(where)], check=True)
    python = where / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _quiet([*pip, f"torch=={entry.torch}"])  # first and pinned: nothing resolves another torch
    pins = [f"lightning=={entry.lightning}", f"torch=={entry.torch}"]
    if entry.transformers:
        pins.append(f"transformers=={entry.transformers}")
    _quiet([*pip, "-e", f"{REPO}[test]", *pins])
    seconds = time.perf_counter() - start
    record.write_text(json.dumps({"key": _requirements_key(entry), "built_s": round(seconds, 1)}))
    return python, "built", seconds


def _quiet(command: list[str]) -> None:
    """Run a pip command, showing its output only if it fails (pip's notes on this machine's index run to pages)."""
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-5000:] + done.stderr[-5000:])
        raise subprocess.CalledProcessError(done.returncode, command)


def versions_of(python: Path) -> dict[str, str]:
    script = (
        "import json, torch, lightning, transformers, lightning_zero.torch_versions as tv;"
        "from lightning_zero.engine.stage3 import fsdp2_private;"
        "print(json.dumps({'torch': torch.__version__, 'lightning': lightning.__version__,"
        " 'transformers': transformers.__version__,"
        " 'branches': {**fsdp2_private.branches(), **tv.branches()}}))"
    )
    return json.loads(
        subprocess.run([str(python), "-c", script], check=True, capture_output=True, text=True, cwd=REPO).stdout
    )


def run_cases(python: Path, junit: Path) -> tuple[int, float]:
    start = time.perf_counter()
    command = [
        str(python),
        "-m",
        "pytest",
        "-q",
        "-m",
        "not full",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *CASES,
    ]
    code = subprocess.run(command, cwd=REPO).returncode
    return code, time.perf_counter() - start


def figures(junit: Path) -> list[tuple[str, str, dict[str, str]]]:
    """(test, outcome, recorded figures) of each case in a JUnit file."""
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = (
            "failed"
            if case.find("failure") is not None or case.find("error") is not None
            else ("skipped" if case.find("skipped") is not None else "passed")
        )
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        out.append((f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}", outcome, props))
    return out


def cross_version(writer: Path, reader: Path, directory: Path) -> dict:
    """Write under ``writer``'s torch, resume under ``reader``'s: the resume worker's report, or what failed."""
    env = {**os.environ, "LZ_SHARED_DIR": str(directory)}
    for python, case in ((writer, "write"), (reader, "resume")):
        script = (
            "import json, sys; from tests.launch import launch;"
            f"print('REPORT' + json.dumps(launch('tests.distributed.worker_torch_versions', '{case}', nprocs=2,"
            " env={'LZ_SHARED_DIR': sys.argv[1]})))"
        )
        done = subprocess.run(
            [str(python), "-c", script, str(directory)], cwd=REPO, env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            return {"failed": case, "output": (done.stdout + done.stderr)[-3000:]}
        report = json.loads(done.stdout.split("REPORT", 1)[1])
    return report["resume"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="torch versions to run (default: every entry)")
    args = parser.parse_args()
    entries = [e for e in MATRIX if not args.only or e.torch in args.only]
    results, failed = {}, False
    out = Path(tempfile.mkdtemp(prefix="lz-torch-matrix-"))
    for entry in entries:
        python, how, build_s = ensure_venv(entry)
        installed = versions_of(python)
        code, test_s = run_cases(python, out / f"{entry.name}.xml")
        failed |= code != 0
        results[entry.name] = dict(
            entry=entry,
            python=python,
            how=how,
            build_s=build_s,
            installed=installed,
            code=code,
            test_s=test_s,
            cases=figures(out / f"{entry.name}.xml"),
        )
    cross = {}
    if len(entries) > 1:
        oldest, newest = results[entries[0].name]["python"], results[entries[-1].name]["python"]
        for label, writer, reader in (("oldest -> newest", oldest, newest), ("newest -> oldest", newest, oldest)):
            with tempfile.TemporaryDirectory() as directory:
                cross[label] = cross_version(writer, reader, Path(directory))
    for name, result in results.items():
        installed = result["installed"]
        print(
            f"\n== {name}: torch {installed['torch']}, lightning {installed['lightning']}, transformers "
            f"{installed['transformers']}; venv {result['how']} in {result['build_s']:.1f} s; cases in "
            f"{result['test_s']:.1f} s, exit {result['code']}"
        )
        for difference, branch in installed["branches"].items():
            print(f"   {difference}: {branch}")
        counts: dict[str, int] = {}
        for test, outcome, props in result["cases"]:
            counts[outcome] = counts.get(outcome, 0) + 1
            if props or outcome == "failed":
                shown = ", ".join(f"{k} {float(v):.3g}" if _number(v) else f"{k} {v}" for k, v in props.items())
                print(f"   {outcome:7} {test}  {shown}")
        print("   " + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())))
    for label, report in cross.items():
        print(f"\n== checkpoint {label}")
        if "failed" in report:
            print(f"   the {report['failed']} half failed:\n{report['output']}")
            failed = True
            continue
        for stage, result in report.items():
            if "refused" in result:
                print(f"   {stage}: written by {result['written_by']}, refused: {result['refused'][:400]}")
                failed |= label == "oldest -> newest"  # torch promises old-to-new DCP loading only
                continue
            print(
                f"   {stage}: written by {result['written_by']}, resumed by {result['resumed_by']}: max |dparam| vs "
                f"this torch's uninterrupted run {result['param_diff']:.3g}, optimizer state {result['optim_diff']:.3g}, "
                f"vs the writer's uninterrupted run {result['param_diff_to_writer']:.3g}"
            )
            try:
                check_resumed(f"{label} {stage}", result)
            except AssertionError as error:
                print(f"   NOT EXACT: {error}")
                failed = True
    print(f"\nJUnit files in {out}; venvs in {venv_root()}")
    return 1 if failed else 0


def _number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
