"""No run hangs (issue 18 part 2): every fault ends every rank within ``timeout`` (plus a few seconds), with an
error on every rank that names the rank at fault and where (the collective's kind and number, the call site).

Each case is one launch of ``worker_hangs.py`` (a fault ends processes) through a real ``Trainer`` on gloo
with ``timeout=8``. gloo notices a dead peer (its sockets close); NCCL does not, so the NCCL-style cases keep
the faulty rank alive: stopped with SIGSTOP, or sleeping after its own error. The default run (``make
test``) has six representative cases; the rest of the matrix is marked ``full``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.distributed import popen_mismatch
from tests.launch import REPO, launch_processes

pytestmark = [pytest.mark.slow, pytest.mark.alone]

TIMEOUT = 8.0
#: A hang ends within the timeout plus the watchdog's margin and grace (Limits.for_timeout(8): 2 s each) and
#: the process's own exit; on 2 busy cores, a few seconds more.
BOUND = TIMEOUT + 8.0
COLLECTIVE = re.compile(
    r"(all_gather|reduce_scatter|all_reduce|broadcast\w*|barrier|isend|irecv)( #\d+| \(world op \d+\))"
)


def run(case: str, nprocs: int = 2, timeout: float = TIMEOUT, watchdog: bool = True, **kwargs):
    return launch_processes(
        "tests.distributed.worker_hangs",
        case,
        nprocs=nprocs,
        timeout=90,
        env={"LZ_TIMEOUT": str(timeout), "LZ_WATCHDOG": "1" if watchdog else "0"},
        **kwargs,
    )


#: The default cases, all launched together when the module starts: most of a case is waiting for a timeout,
#: and the ranks are forked from the fork server, which has imported everything already.
DEFAULT_CASES = {
    "sigstop": {},
    "sleep_forever": {"timeout": 60, "signal_on_fault": signal.SIGTERM},
    "generate": {},
    "uneven": {},
    "sigkill": {},
    "raise_step": {},
    "conditional_log": {},
    "pipelined_kill": {},
    "experts_as_units": {},
    "save_on_rank0": {},
}


def run_popen_mismatch(sampling_rank: int) -> tuple[subprocess.CompletedProcess, float | None]:
    """``tests/distributed/popen_mismatch.py`` as a user runs a script (Lightning's popen launcher), and the seconds
    from the ranks' parting (the script prints when) to the end of every process: its start-up (imports, two
    processes) is not the fault's to bound."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.distributed.popen_mismatch", str(sampling_rank)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    ended = time.time()
    parted = re.search(re.escape(popen_mismatch.FAULT_LINE) + r"([\d.]+)", result.stdout)
    return result, ended - float(parted.group(1)) if parted else None


#: Two Python busy loops, as a user's data loader workers or a second job keep a 2-core machine busy; each ends by
#: itself after this many seconds should the session that started it die first.
BUSY_LOOP = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"


@contextlib.contextmanager
def busy_cores(count: int = 2, seconds: float = 600):
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(seconds=seconds)]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def launch_default_cases(pool: ThreadPoolExecutor) -> dict:
    futures = {case: pool.submit(run, case, **kwargs) for case, kwargs in DEFAULT_CASES.items()}
    futures.update({f"popen_mismatch_{rank}": pool.submit(run_popen_mismatch, rank) for rank in (0, 1)})
    return futures


#: Runs at once: twelve (24 processes on 2 cores) stalled ranks for 4-6 s on a machine whose page cache keeps nothing
#: (every page fault a disk read, 24 processes in line for it), longer than ``stale_after`` (4 s): heartbeats and the
#: failure records behind the diagnoses arrived late (benchmarks/results/2026-12-07-fresh-clone.md).
AT_ONCE = 6


@pytest.fixture(scope="module")
def launched():
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        yield launch_default_cases(pool)


@pytest.fixture(scope="module")
def launched_under_load():
    """The default cases again, beside two busy loops (``make test-all``): the diagnoses must name the same rank and
    say the same when the ranks wait for cores."""
    with busy_cores(), ThreadPoolExecutor(max_workers=len(DEFAULT_CASES) + 2) as pool:
        futures = launch_default_cases(pool)
        for future in futures.values():
            future.result()
    yield futures


def assert_all_failed_in_time(result, bound: float = BOUND, ranks=None):
    for rank in ranks if ranks is not None else range(len(result.ranks)):
        outcome = result.ranks[rank]
        assert outcome.code not in (0, None), f"rank {rank} exited with {outcome.code}:\n{outcome.output[-4000:]}"
        assert result.since_fault(rank) <= bound, f"rank {rank} took {result.since_fault(rank):.1f} s after the fault"


def assert_names(output: str, *texts: str, collective: bool = True) -> None:
    for text in texts:
        assert text in output, f"{text!r} missing from:\n{output[-4000:]}"
    if collective:
        assert COLLECTIVE.search(output), f"no collective named in:\n{output[-4000:]}"


# ---------------------------------------------------------------------------------------------- make test
def test_a_rank_that_raises_brings_every_rank_down_with_its_error(launched):
    result = launched["raise_step"].result()
    assert_all_failed_in_time(result)
    survivor = result.output(0)
    assert_names(
        survivor,
        "rank 1 raised ValueError: boom from rank 1 at batch 2",
        "training batch 2",
        "worker_hangs.py",
        "This rank (0) was in training batch 2, waiting in",
    )
    assert_names(result.output(1), "ValueError: boom from rank 1 at batch 2", "the other ranks stop with it")


def test_a_killed_rank_is_named(launched):
    result = launched["sigkill"].result()
    assert result.ranks[1].code == -signal.SIGKILL
    assert_all_failed_in_time(result, ranks=[0])
    assert_names(
        result.output(0),
        "rank 1's process ended without reporting an error",
        "SIGKILL",
        "This rank (0) was in training batch 2, waiting in reduce_scatter #",
    )


def test_a_killed_pipeline_stage_is_named_with_its_stage(launched):
    """Under pipeline stages the watchdog names what the rank ran, beside its number."""
    result = launched["pipelined_kill"].result()
    assert result.ranks[1].code == -signal.SIGKILL
    assert_all_failed_in_time(result, ranks=[0])
    assert_names(
        result.output(0),
        "rank 1 (pipeline stage 1 of replica 0)'s process ended without reporting an error",
        "This rank (0) was in training batch 2",
        collective=False,
    )


def test_a_stopped_rank_nccl_style_is_named_and_every_rank_ends(launched):
    """SIGSTOP: alive, sockets open, no progress (what a hung NCCL rank looks like): nothing raises on its peer,
    the watchdog notices the missing heartbeat. Once the peer has ended, the harness continues the stopped rank,
    which then ends too, saying it was stopped."""
    result = launched["sigstop"].result()
    assert_all_failed_in_time(result, ranks=[0])
    assert_names(
        result.output(0),
        "rank 1 stopped responding: no heartbeat",
        "its process is stopped",
        "This rank (0) is in training batch 2, waiting in reduce_scatter #",
        "ending this process",
    )
    assert result.ranks[1].code not in (0, None)
    assert result.ranks[1].exited_at - result.ranks[0].exited_at <= 10  # promptly once continued
    assert_names(result.output(1), "rank 1's process could not run for", collective=False)


def test_the_rank_with_fewer_batches_does_not_report_success(launched):
    result = launched["uneven"].result()
    for rank in (0, 1):
        assert result.ranks[rank].code not in (0, None), result.output(rank)[-3000:]
        assert result.ranks[rank].exited_at <= 60
        assert_names(
            result.output(rank),
            "rank 1 finished (4 training batches",
            "rank 0 still runs",
            "ran different numbers of batches",
            "use_distributed_sampler",
        )


def test_hugging_face_generate_under_stage_3(launched):
    """Per-rank output lengths work by default (transformers turns ``synced_gpus`` on for FSDP-managed modules,
    which stage 3's are); with ``synced_gpus=False`` the extra forward passes of one rank pair silently with the
    other's, and the run ends naming the rank, the all-gather and ``synced_gpus=True``."""
    result = launched["generate"].result()
    report = result.report()
    assert report["default"]["lengths"] == {"0": 6, "1": 6}  # rank 0: 4 prompt + 2 new tokens; rank 1 made 8
    assert_all_failed_in_time(result)
    for rank in (0, 1):
        assert_names(
            result.output(rank),
            "rank 1 still runs",
            "validation batch 0, waiting in all_gather #",
            "in validation_step via generation/utils.py",
            "synced_gpus=True",
        )


def test_sigterm_ends_a_hung_run_within_30_seconds(launched):
    """Rank 1 hangs in user code and rank 0 waits for it in a collective; the timeout is long (60 s), so only
    the scheduler's SIGTERM (sent to both) ends the run."""
    result = launched["sleep_forever"].result()
    assert result.signalled_at is not None
    for rank in (0, 1):
        outcome = result.ranks[rank]
        assert outcome.code not in (0, None), outcome.output[-3000:]
        assert outcome.exited_at - result.signalled_at <= 30
        assert_names(outcome.output, "received SIGTERM", collective=False)
    assert_names(
        result.output(0), "rank 0 received SIGTERM and ended while waiting in a collective", "reduce_scatter #"
    )
    assert result.ranks[0].code == 128 + signal.SIGTERM
    assert re.search(r"rank 0('s process ended after it)? received SIGTERM", result.output(1)), result.output(1)[-3000:]


# ---------------------------------------------------------------------------------------------- full matrix
#: `make test-all`'s cases, launched four at a time once the default cases have ended (a slow rank's steps take 0.6 x
#: the timeout: with thirteen runs beside it, rank 0's wait for it outlasted the timeout).
FULL_CASES = {
    **{
        case: {}
        for case in (
            "raise_backward",
            "raise_optimizer",
            "raise_callback",
            "raise_save",
            "raise_and_sleep",
            "sigstop0",
            "skip_step",
            "rank_only_submodule",
            "slow",
            "one_sided",
        )
    },
    "raise_and_sleep_4_ranks": {"case": "raise_and_sleep", "nprocs": 4},
    "raise_step_without_watchdog": {"case": "raise_step", "watchdog": False},
    "sigterm_healthy": {"signal_on_fault": signal.SIGTERM},
}


@pytest.fixture(scope="module")
def full_launched(launched):
    for future in launched.values():
        future.exception()  # waits; a default case's failure is its own test's to report
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield {
            name: pool.submit(run, kwargs.pop("case", name), **kwargs)
            for name, kwargs in ((n, dict(k)) for n, k in FULL_CASES.items())
        }


@pytest.mark.full
@pytest.mark.parametrize(
    "case, error",
    [
        ("raise_backward", "RuntimeError: boom in backward on rank 1"),
        ("raise_optimizer", "RuntimeError: boom in optimizer.step on rank 1"),
        ("raise_callback", "KeyError: 'boom in a callback on rank 1'"),
        ("raise_save", "OSError: boom in on_save_checkpoint on rank 1"),
    ],
)
def test_a_rank_that_raises_anywhere(full_launched, case, error):
    result = full_launched[case].result()
    assert_all_failed_in_time(result)
    assert_names(result.output(0), f"rank 1 raised {error}", "This rank (0) was in training batch")
    assert_names(result.output(1), error, collective=False)


@pytest.mark.full
def test_a_failed_rank_that_stays_alive_nccl_style(full_launched):
    """The failed rank catches its error and lingers (sockets open): its peer is ended by the watchdog."""
    result = full_launched["raise_and_sleep"].result()
    assert_all_failed_in_time(result, ranks=[0])
    assert_names(result.output(0), "rank 1 raised ValueError: boom from rank 1", "ending this process")
    assert result.ranks[1].code == 3  # the worker's own exit after lingering


@pytest.mark.full
def test_the_store_host_stopped(full_launched):
    """Rank 0 hosts the store under this launcher: stopped, it takes the store with it."""
    result = full_launched["sigstop0"].result()
    assert_all_failed_in_time(result, ranks=[1])
    assert_names(result.output(1), "cannot reach the rendezvous store", "rank 0 is probably stopped")
    assert result.ranks[0].code not in (0, None)
    assert_names(result.output(0), "rank 0's process could not run for", collective=False)


@pytest.mark.full
def test_a_rank_that_skips_a_step(full_launched):
    result = full_launched["skip_step"].result()
    assert_all_failed_in_time(result)
    for rank in (0, 1):
        assert_names(
            result.output(rank), "is in a different collective", "reduce_scatter #16", "torch.distributed.broadcast"
        )


def test_a_conditional_sync_dist_log(launched):
    """Ranks that issue different collectives (an all-reduce only rank 0 issues): named after the timeout."""
    result = launched["conditional_log"].result()
    assert_all_failed_in_time(result)
    for rank in (0, 1):
        assert_names(result.output(rank), "all_reduce #16", "worker_hangs.py", "different collective")


def test_a_save_on_rank_0_only_is_named_with_the_way_out(launched):
    """``trainer.save_checkpoint`` under ``if trainer.is_global_zero:`` (collective here, as under FSDP and DeepSpeed):
    after the timeout every rank names the save as where rank 0 is, and says to save on every rank."""
    result = launched["save_on_rank0"].result()
    assert_all_failed_in_time(result)
    for rank in (0, 1):
        output = result.output(rank)
        # rank 0's wait, in whichever rank's diagnosis came first
        assert re.search(
            r"called from distributed/worker_hangs\.py:\d+ in on_train_batch_end via \S+ in "
            r"save_checkpoint",
            output,
        ), output[-3000:]
        assert "`Trainer.save_checkpoint` is collective under ZeroStrategy" in output
        assert "not under `if trainer.is_global_zero:`" in output


def test_experts_made_units_of_their_own_and_picked_per_rank_are_named_where_the_ranks_part(launched):
    """Stage 3, each expert a unit of its own (``unit_size_mb=0``), the ranks routing to different experts of one size
    at batch 2: their all-gathers pair silently by size, each rank computing with the other's expert. The flight
    recorder carries each collective's unit ([Note: operation numbers and the running hash]), so the first
    difference names both experts, with what to do, and every rank ends (gloo aborts one later in the step)."""
    result = launched["experts_as_units"].result()
    assert_all_failed_in_time(result)
    output = result.output(0) + result.output(1)
    found = re.search(
        r"the first that differs is #(\d+): all_gather #\1 \(72 x float32, experts\.(\d)\)[^#]*"
        r"all_gather #\1 \(72 x float32, experts\.(\d)\)",
        output,
    )
    assert found and {found[2], found[3]} == {"0", "1"}, output[-3000:]
    assert "keep it inside a unit every rank runs" in output


@pytest.mark.full
def test_a_submodule_used_on_one_rank_under_stage_3(full_launched):
    """gloo aborts the rank whose all-gather does not match (NCCL would hang): its peer names it, the collective
    and the call site, from the crashed rank's flight file and Python stack."""
    result = full_launched["rank_only_submodule"].result()
    assert_all_failed_in_time(result)
    assert_names(
        result.output(0),
        "rank 1's process crashed in native code (SIGABRT",
        "in training batch 2",
        "called from distributed/worker_hangs.py",
        "in training_step",
        "the first that differs is #",
        "Every rank must issue the same collectives",
    )
    assert "collective mismatch" in result.output(1)  # gloo's own message, on the rank it ended


@pytest.mark.parametrize("sampling_rank", [0, 1])
def test_a_collective_mismatch_that_gloo_aborts_is_named_under_lightnings_launcher(launched, sampling_rank):
    """``python script.py`` (Lightning's popen launcher), stage 3, one rank samples from a submodule in
    ``validation_step``: gloo aborts one process in C++ (rank 0, which holds the store, or its child rank 1).
    The survivor prints the watchdog's diagnosis: the crashed rank, its collective by kind, number and size
    against the survivor's, its call site, and what to do; and every process ends."""
    result, since_fault = launched[f"popen_mismatch_{sampling_rank}"].result()
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert since_fault is not None, output[-5000:]
    assert since_fault <= BOUND, f"the processes ended {since_fault:.0f} s after the ranks parted"
    assert "collective mismatch in your code" in output  # gloo's message from the process it aborted
    # gloo may abort the process in its background thread after the all_gather returned there: its flight record then
    # says the collective was the last it issued rather than the one it is in (seen once under `make test-all`)
    assert re.search(
        r"rank [01]'s process crashed in native code \(SIGABRT; its Python stack is in \S+rank[01]\.fatal\) "
        r"in validation batch 0, (in all_gather #\d+ \(\d+ x float32, [\w.]+\)|not in a collective \(the "
        r"last it issued: all_gather #\d+\)), called from distributed/popen_mismatch\.py:\d+ in validation_step",
        output,
    ), output[-5000:]
    assert re.search(
        r"the first that differs is #\d+: all_gather #\d+ \(1056 x float32, sampler\.0\) on rank \d vs "
        r"all_gather #\d+ \(\d+ x float32, [\w.]+\) on rank \d",
        output,
    ), output[-5000:]
    assert "Every rank must issue the same collectives in the same order" in output


@pytest.mark.full
def test_a_slow_rank_is_not_a_hang(full_launched):
    """Rank 1's steps take 0.6 x timeout (far slower than rank 0's): rank 0 waits nearly that long each step."""
    result = full_launched["slow"].result()
    for rank in (0, 1):
        assert result.ranks[rank].code == 0, result.output(rank)[-3000:]
        assert "[lightning_zero]" not in result.output(rank)


@pytest.mark.full
def test_four_ranks_one_fails_and_stays_alive(full_launched):
    result = full_launched["raise_and_sleep_4_ranks"].result()
    assert_all_failed_in_time(result, ranks=[0, 2, 3])
    for rank in (0, 2, 3):
        assert_names(result.output(rank), "rank 1 raised ValueError: boom from rank 1", "reduce_scatter #16")


@pytest.mark.full
def test_without_the_watchdog_the_first_failure_is_still_named(full_launched):
    """``watchdog=False``: no thread; gloo's own error plus the first failure, and the process-group timeout."""
    result = full_launched["raise_step_without_watchdog"].result()
    assert_all_failed_in_time(result)
    assert_names(
        result.output(0),
        "the run was brought down by the first failure: rank 1 raised ValueError: boom",
        collective=False,
    )
    assert "stop with it" not in result.output(1)  # that line is the watchdog's


@pytest.mark.full
def test_a_long_one_sided_phase_inside_extended_is_not_a_hang(full_launched):
    """Rank 0 works alone for 1.5 x timeout inside ``faults.extended`` while rank 1 waits at its barrier."""
    result = full_launched["one_sided"].result()
    for rank in (0, 1):
        assert result.ranks[rank].code == 0, result.output(rank)[-3000:]
        assert "[lightning_zero]" not in result.output(rank)


@pytest.mark.full
def test_sigterm_during_healthy_training_stops_every_rank_at_a_batch_boundary(full_launched):
    result = full_launched["sigterm_healthy"].result()
    assert result.signalled_at is not None
    for rank in (0, 1):
        outcome = result.ranks[rank]
        assert outcome.code is not None and outcome.exited_at - result.signalled_at <= 30, outcome.output[-3000:]
        assert "received SIGTERM" in outcome.output and "ending this process" not in outcome.output


# ------------------------------------------------------------------------------- make test-all: under load
#: Each default case's checks, as they run on the idle machine.
DEFAULT_CHECKS = {
    "raise_step": test_a_rank_that_raises_brings_every_rank_down_with_its_error,
    "sigkill": test_a_killed_rank_is_named,
    "pipelined_kill": test_a_killed_pipeline_stage_is_named_with_its_stage,
    "sigstop": test_a_stopped_rank_nccl_style_is_named_and_every_rank_ends,
    "uneven": test_the_rank_with_fewer_batches_does_not_report_success,
    "generate": test_hugging_face_generate_under_stage_3,
    "sleep_forever": test_sigterm_ends_a_hung_run_within_30_seconds,
    "conditional_log": test_a_conditional_sync_dist_log,
    "save_on_rank0": test_a_save_on_rank_0_only_is_named_with_the_way_out,
    "experts_as_units": test_experts_made_units_of_their_own_and_picked_per_rank_are_named_where_the_ranks_part,
    "popen_mismatch_0": functools.partial(
        test_a_collective_mismatch_that_gloo_aborts_is_named_under_lightnings_launcher, sampling_rank=0
    ),
    "popen_mismatch_1": functools.partial(
        test_a_collective_mismatch_that_gloo_aborts_is_named_under_lightnings_launcher, sampling_rank=1
    ),
}


@pytest.mark.full
@pytest.mark.parametrize("case", sorted(DEFAULT_CHECKS))
def test_the_default_cases_are_diagnosed_alike_on_busy_cores(launched_under_load, case):
    DEFAULT_CHECKS[case](launched_under_load)
