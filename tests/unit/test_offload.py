"""Host-memory pieces of CPU offload that need no processes: pinning policy, host kernel choice, masters."""

import pytest
import torch

from lightning_zero.engine.offload.host_step import host_kernel
from lightning_zero.engine.offload.masters import MasterShards, should_pin
from lightning_zero.engine.offload.schedule import HostPart, HostStepSchedule, StepMode
from lightning_zero.engine.offload.speculation import CopyBuffers
from lightning_zero.engine.offload.worker import HostStepWorker, host_step_threads


def test_pinning_follows_the_accelerator():
    assert should_pin(torch.device("cpu"), None) is False
    assert should_pin(torch.device("cuda", 0), None) is True
    assert should_pin(torch.device("cuda", 0), False) is False
    with pytest.warns(UserWarning, match="pin_memory=True.*no accelerator"):
        assert should_pin(torch.device("cpu"), True) is False


def _adamw(**kwargs):
    params = [torch.nn.Parameter(torch.randn(6, 3)), torch.nn.Parameter(torch.randn(3))]
    for p in params:
        p.grad = torch.randn_like(p)
    return torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2, **kwargs)


def test_host_kernel_uses_the_fused_cpu_kernel_and_restores_the_users_choice():
    opt = _adamw()
    seen = []
    with host_kernel(opt):
        seen = [g["fused"] for g in opt.param_groups]
        opt.step()
    assert seen == [True, True]
    assert [g["fused"] for g in opt.param_groups] == [None, None]
    assert opt.state_dict()["param_groups"][0]["fused"] is None


@pytest.mark.parametrize("kwargs", [dict(foreach=True), dict(foreach=False), dict(fused=False)])
def test_host_kernel_keeps_an_explicit_kernel_choice(kwargs):
    opt = _adamw(**kwargs)
    before = [(g["foreach"], g["fused"]) for g in opt.param_groups]
    with host_kernel(opt):
        assert [(g["foreach"], g["fused"]) for g in opt.param_groups] == before


def test_fused_host_step_matches_the_default_step():
    torch.manual_seed(0)
    a, b = _adamw(), _adamw()
    for pa, pb in zip(a.param_groups, b.param_groups):
        for x, y in zip(pa["params"], pb["params"]):
            y.data.copy_(x.data)
            y.grad.copy_(x.grad)
    for _ in range(3):
        with host_kernel(a):
            a.step()
        b.step()
    for pa, pb in zip(a.param_groups, b.param_groups):
        for x, y in zip(pa["params"], pb["params"]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_offloaded_masters_copy_gradients_into_reused_host_buffers():
    shards = [torch.randn(4, 2, dtype=torch.bfloat16), torch.randn(3, dtype=torch.bfloat16)]
    masters = MasterShards(shards, dtype=torch.float32, offloaded=True)
    assert [m.dtype for m in masters] == [torch.float32, torch.float32]
    assert all(m.untyped_storage().data_ptr() != s.untyped_storage().data_ptr() for m, s in zip(masters, shards))
    grads = masters.receive_gradients({0: torch.ones(4, 2, dtype=torch.bfloat16), 1: None})
    assert grads[1] is None and grads[0].dtype == torch.float32 and torch.equal(grads[0], torch.ones(4, 2))
    again = masters.receive_gradients({0: torch.full((4, 2), 2.0, dtype=torch.bfloat16)})
    assert again[0] is grads[0] and torch.equal(again[0], torch.full((4, 2), 2.0))
    target = torch.zeros(4, 2, dtype=torch.bfloat16)
    masters.copy_into(0, target)
    assert torch.equal(target, shards[0])


def test_masters_reach_many_flat_rows_in_one_copy_and_an_aliased_master_is_left_alone():
    rows = [torch.randn(4, 2), torch.randn(3)]
    masters = MasterShards(rows, dtype=None, offloaded=0.5, alias_on_device=True)
    assert masters.on_host == [False, True] and masters.aliased == {0}
    masters.tensors[1].add_(1.0)  # the host master moved on; the resident rows have not yet
    resident = [rows[0].view(-1), torch.zeros(3, dtype=torch.bfloat16)]
    masters.copy_all_into([(0, resident[0]), (1, resident[1])])
    assert torch.equal(resident[1], masters.tensors[1].to(torch.bfloat16))
    assert resident[0].data_ptr() == masters.tensors[0].data_ptr()


def test_device_masters_use_the_gradients_where_they_are():
    masters = MasterShards([torch.randn(4)], dtype=torch.float32, offloaded=False)
    grad = torch.randn(4)
    assert masters.receive_gradients({0: grad})[0] is grad
    assert masters.gradient_buffers == []


def test_the_host_step_splits_into_consecutive_runs_of_about_equal_size():
    from lightning_zero.engine.offload.schedule import split_in_parts

    assert split_in_parts([5, 5, 5, 5], parts=2) == [[0, 1], [2, 3]]
    assert split_in_parts([10, 1, 1, 1, 1], parts=2) == [[0], [1, 2, 3, 4]]  # a large bucket is a part of its own
    assert split_in_parts([1, 1, 1], parts=8) == [[0], [1], [2]]  # never more parts than buckets
    assert split_in_parts([], parts=8) == []


def test_only_optimizers_whose_state_is_per_parameter_and_without_step_hooks_step_in_parts():
    from lightning_zero.engine.optimizers import steps_in_parts

    params = [torch.nn.Parameter(torch.zeros(2))]
    adamw = torch.optim.AdamW(params)
    assert steps_in_parts(adamw)
    handle = adamw.register_step_post_hook(lambda *_: None)  # a hook would see one step as several
    assert not steps_in_parts(adamw)
    handle.remove()
    assert steps_in_parts(adamw)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    global_hook = register_optimizer_step_pre_hook(lambda *_: None)
    try:
        assert not steps_in_parts(adamw)
    finally:
        global_hook.remove()
    assert not steps_in_parts(torch.optim.LBFGS(params))  # state kept across all parameters
    assert steps_in_parts(torch.optim.RMSprop(params)) and steps_in_parts(torch.optim.NAdam(params))  # no fused kernel


def test_a_stepping_view_reads_the_groups_as_they_were_and_writes_the_optimizers_state():
    """The delayed host step steps a view of the user's optimizer in another thread: what the training thread
    does to the param groups meanwhile (an LR scheduler's next rate) is not what the step reads, the state it
    writes is the optimizer's own, and an LR scheduler still sees the optimizer as stepped."""
    from lightning_zero.engine.optimizers import stepping_view

    opt = _adamw()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    twin = _adamw()
    twin.load_state_dict(opt.state_dict())
    for p, q in zip(
        (p for g in opt.param_groups for p in g["params"]), (p for g in twin.param_groups for p in g["params"])
    ):
        q.data.copy_(p.data)
        q.grad = p.grad.clone()
    view = stepping_view(opt)
    scheduler.step()  # the training thread moves on: the next step's rate
    assert opt.param_groups[0]["lr"] == 5e-3 and view.param_groups[0]["lr"] == 1e-2
    view.step()
    twin.step()
    for p, q in zip(
        (p for g in opt.param_groups for p in g["params"]), (p for g in twin.param_groups for p in g["params"])
    ):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], twin.state[q]["exp_avg"])
    assert opt._opt_called  # what the scheduler checks before its first step


def test_a_delayed_update_refuses_an_optimizer_that_steps_whole_parameters():
    from lightning_zero.engine.stage12.zero_dp import ZeroDataParallel

    engine = ZeroDataParallel(
        torch.nn.Linear(4, 4), stage=2, bucket_numel=64, offload_optimizer=True, offload_step_delay=1
    )
    try:
        with pytest.raises(TypeError, match=r"offload_step_delay=1.*element-wise optimizer.*offload_step_delay=0"):
            engine.wrap_optimizer(torch.optim.Muon([engine.params[0]], lr=1e-2))
    finally:
        engine.teardown()


def test_finished_units_are_told_in_reduction_order_once_their_gradients_are_made():
    """[Note: the host step during backward] at stage 3: a unit reduced in place is finished only when the next
    reduce-scatter begins (FSDP2 makes its gradients after the collective returns) or backward ends; one landing
    late, once it landed; a later unit never overtakes an earlier one; nothing is told without a listener."""
    from lightning_zero.engine.stage3.fsdp2_comm import FinishedUnits

    finished, told = FinishedUnits(), []
    finished.reduced(0, landed=True)
    finished.announce()
    assert told == []  # nobody listening: nothing queued
    finished.listen(told.append)
    finished.reduced(0, landed=True)  # in place: gradients made after this call returns
    assert told == []
    finished.announce()  # unit 1's reduce-scatter begins
    assert told == [0]
    late = finished.reduced(1, landed=False)
    finished.reduced(2, landed=True)
    finished.announce()
    assert told == [0]  # unit 2 waits behind unit 1, still in flight
    late.landed = True
    finished.announce()
    assert told == [0, 1, 2]
    finished.reduced(3, landed=True)
    finished.finish()  # backward ended: the rest, then no listener
    assert told == [0, 1, 2, 3] and not finished.listening
    finished.reduced(4, landed=True)
    finished.announce()
    assert told == [0, 1, 2, 3]


def test_on_one_rank_a_unit_is_finished_once_the_next_units_output_is_allocated():
    """[Note: units finished alone]: FSDP2 allocates each unit's input, then its output (standing for the reduce-scatter
    it does not call); a unit run twice in forward does so twice; a backward left half-way is forgotten."""
    from lightning_zero.engine.stage3.fsdp2_comm import FinishedUnits

    finished, told = FinishedUnits(), []
    finished.allocated(0)  # nobody listening: nothing kept
    finished.listen(told.append)
    finished.allocated(0)  # unit 0's input
    finished.allocated(0)  # its output: it copies into it next
    assert told == []
    finished.allocated(1)
    assert told == []
    finished.allocated(1)  # unit 1's output: unit 0 has its gradients
    assert told == [0]
    finished.allocated(1)
    finished.allocated(1)  # unit 1 again (run twice in forward): its first copy is done
    assert told == [0, 1]
    finished.allocated(2)  # unit 2's input, then backward ends without its output
    finished.finish()
    assert told == [0, 1, 1]
    finished.listen(told.append)
    finished.allocated(2)  # the next backward starts afresh: an input, not an output
    assert told == [0, 1, 1]


def test_host_steps_beside_an_accelerator_leave_the_cores_that_drive_it():
    """[Note: host-step threads]: with an accelerator the worker steps with two threads fewer than the budget (at
    least one), in its own thread only; on a CPU it keeps torch's count."""
    assert host_step_threads(torch.device("cuda", 0), budget=16) == 14
    assert host_step_threads(torch.device("cuda", 0), budget=2) == 1
    assert host_step_threads(torch.device("cpu"), budget=16) is None and host_step_threads(None) is None
    before = torch.get_num_threads()
    worker = HostStepWorker(torch.device("cpu"), threads=1)
    try:
        stepped = worker.start(torch.get_num_threads)
        stepped.wait()
        assert stepped.future is not None and stepped.future.result() == 1
        assert torch.get_num_threads() == before  # the training thread keeps its own
    finally:
        worker.close()
    worker = HostStepWorker(torch.device("cpu"))
    try:
        assert worker.start(torch.get_num_threads).future.result() == before  # type: ignore[union-attr]
    finally:
        worker.close()


def test_every_mode_of_the_schedule_steps_through_the_one_host_step():
    """``offload/schedule.py``: a part started during backward is averaged and stepped in the worker and sent back
    by the step; the delayed mode steps in the worker after the step call; both read as the mode they are."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    worker = HostStepWorker(torch.device("cpu"))
    try:
        during = HostStepSchedule(optimizer, worker)
        assert during.mode is StepMode.SERIAL
        master, grad = torch.ones(4), torch.full((4,), 2.0)
        part = HostPart(pieces=(0,), indices=(0,))
        during.start(part, {id(param): (master, grad)}, None, average=([grad], 0.5))
        assert during.mode is StepMode.DURING_BACKWARD
        with pytest.raises(RuntimeError, match="Cannot skip this optimizer step"):
            during.refuse("skip this optimizer step")
        sent: list[HostPart] = []
        assert during.send_back(during.take(), sent.append) == {0} and sent == [part]
        assert torch.equal(master, torch.full((4,), 0.9))  # the gradient averaged to 1 first
        assert during.mode is StepMode.SERIAL and torch.equal(param.detach(), torch.ones(4))
        delayed = HostStepSchedule(optimizer, worker, delayed=True)
        assert delayed.mode is StepMode.DELAYED
        delayed.start_delayed([({id(param): (master, torch.ones(4))}, None)])
        delayed.settle()
        pending = delayed.take_pending()
        assert pending is not None and delayed.pending is None
        assert torch.allclose(master, torch.full((4,), 0.8))
    finally:
        worker.close()


def test_speculation_copy_buffers_are_reused_and_those_no_copy_used_are_freed():
    """A tensor replaced (a loaded checkpoint's state) leaves no full-size copy behind once a step copied without it."""
    buffers = CopyBuffers()
    kept, replaced = torch.randn(1000), torch.randn(500)
    first = buffers.copied(kept)
    buffers.copied(replaced)
    buffers.forget_unused()
    assert buffers.nbytes() == 1500 * 4
    assert buffers.copied(kept) is first and torch.equal(first, kept)
    buffers.forget_unused()
    assert buffers.nbytes() == 1000 * 4
