"""``stage="auto"`` in one process: its settings and refusals, the arguments a user gave (from Python and from
LightningCLI), the planner's search (the pick an exhaustive search makes, with fewer traces; micro-batches on a line
through two traces), what the choice keeps of the settings given, and splitting a batch."""

import dataclasses

import lightning as L
import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.config.choices import ZeroConfigError
from lightning_zero.config.zero_config import ZeroConfig
from lightning_zero.demo.gpt import Block, GPTLightningModule
from lightning_zero.planning import Planner
from lightning_zero.planning.auto import AutoChoice, Budget, choose, repeated_block, splittable
from lightning_zero.planning.plan import CONFIGURATIONS, NothingFits, relative_time
from lightning_zero.planning.trace import on_the_line, trace_step
from lightning_zero.strategy.micro_batches import split

GPT = dict(vocab_size=34, block_size=64, n_layer=4, n_head=4, n_embd=128)
MIB = 2**20


def _tokens(size: int = 16, length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 34, (size, length), generator=torch.Generator().manual_seed(0))
    return tokens, tokens


def _planner(**kwargs) -> Planner:
    return Planner(
        lambda: GPTLightningModule(**GPT), _tokens(), world_size=2, checkpointing=Block, backend="gloo", **kwargs
    )


def _arguments(**given) -> dict:
    config = ZeroConfig(stage="auto", **given)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(ZeroConfig)}


def test_zero_auto_is_registered_and_reads_auto_until_it_chooses():
    trainer = L.Trainer(strategy="zero_auto", accelerator="cpu", devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.stage == "auto" and not strategy.zero_config.chosen
    assert not strategy.zero_config.shards_parameters and not strategy.zero_config.optimizer_on_host
    assert strategy.auto_choice is None and strategy.auto_measured_peak is None


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        (dict(stage=2, device_memory="8GiB"), "`device_memory`"),
        (dict(stage=3, memory_headroom=0.2), "`memory_headroom`"),
        (dict(stage="auto", device_memory="lots"), "`device_memory`"),
        (dict(stage="auto", device_memory=-1), "`device_memory`"),
        (dict(stage="auto", memory_headroom=1.0), "`memory_headroom`"),
        (dict(stage="auto", pipeline_stages=2), "pipeline_stages=2"),
        (dict(stage="automatic"), "stage"),
    ],
)
def test_settings_of_the_choice_are_checked_when_the_strategy_is_built(settings, names):
    with pytest.raises(ZeroConfigError, match=names):
        ZeroStrategy(**settings)


def test_device_memory_reads_sizes_as_text():
    assert ZeroStrategy(stage="auto", device_memory="70GiB").zero_config.device_memory == 70 * 2**30
    assert ZeroStrategy(stage="auto", device_memory=1e9).zero_config.device_memory == 10**9


def test_fabric_refuses_auto_and_registers_no_zero_auto():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy

    with pytest.raises(ZeroConfigError, match="needs the Trainer"):
        FabricZeroStrategy(stage="auto")
    assert "zero3" in STRATEGY_REGISTRY and "zero_auto" not in STRATEGY_REGISTRY


def test_the_arguments_given_are_recorded_from_python_and_from_lightningcli():
    """A Python call gives the names it passes; LightningCLI passes every argument with its default filled in, so
    there only the ones that differ from their defaults count."""
    from jsonargparse import ArgumentParser

    assert ZeroStrategy(stage="auto", offload_optimizer=False)._given_arguments == {"stage", "offload_optimizer"}
    assert ZeroStrategy("auto")._given_arguments == {"stage"}
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=ZeroStrategy)
    node = '{"class_path": "lightning_zero.ZeroStrategy", "init_args": {"stage": "auto", "offload_params": true}}'
    strategy = parser.instantiate(parser.parse_args(["--strategy", node])).strategy
    assert strategy._given_arguments == {"stage", "offload_params"}
    assert strategy.stage == "auto" and strategy.zero_config.offload_params


def _exhaustive(planner: Planner, device: float, host: float | None):
    """The pick by weighing every candidate (the search before it stopped early): the fastest fitting, ties to the
    earlier configuration, checkpointing choice and micro-batch."""
    found = []
    micros = [m for m in range(planner.per_device, 0, -1) if planner.per_device % m == 0]
    for ci, configuration in enumerate(CONFIGURATIONS):
        for ki, (ck, off) in enumerate(planner.checkpointing_choices()):
            for mi, micro in enumerate(micros):
                candidate, fits = planner._fill(configuration, ck, off, micro, device, host)
                if candidate is not None and fits:
                    found.append((candidate.relative_time, (ci, ki, mi), candidate))
    return min(found, key=lambda f: f[:2])[2] if found else None


@pytest.mark.parametrize("mib", [40, 16, 11])
def test_the_search_picks_what_weighing_every_candidate_picks(mib):
    fast, every = _planner(), _planner()
    pick = fast.search(mib * MIB, 4 * 2**30).pick
    assert pick == _exhaustive(every, mib * MIB, 4 * 2**30)
    assert len(fast._traces) <= len(every._traces)


def test_an_ample_budget_takes_one_trace():
    planner = _planner()
    search = planner.search(1e9)
    assert search.pick.configuration.stage == 1 and search.pick.micro_batch == 16
    assert list(planner._traces) == [(16, False, False)]
    assert [fits for _, fits in search.weighed] == [True, True]  # zero1, then zero2 (as fast): nothing else


def test_nothing_weighed_before_the_pick_fits_faster():
    search = _planner().search(22 * MIB)
    pick = search.pick
    assert search.weighed[-1][0].relative_time >= pick.relative_time
    assert not any(fits and c.relative_time < pick.relative_time for c, fits in search.weighed)


class Contrastive(L.LightningModule):
    """An in-batch similarity loss: a ``B x B`` matrix, memory that grows faster than the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        z = self.encoder(batch[0])
        logits = z @ z.T  # (B, B)
        return torch.nn.functional.cross_entropy(logits, torch.arange(len(z)))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_the_line_over_predicts_a_term_that_grows_faster_than_the_batch():
    """The micro-batches weighed lie between the two traced ones, where a convex term is under the chord."""
    batch = (torch.randn(512, 64),)
    planner = Planner(Contrastive, batch, world_size=2, backend="gloo")
    for micro in (256, 64, 8):
        line = planner.trace(micro, False)
        traced = trace_step(Contrastive, _first(batch, micro))
        assert line.activation_peak >= traced.activation_peak, micro


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_a_micro_batch_on_the_line_through_two_traces_is_its_trace(model):
    """[Note: micro-batches on a line]: the line through the traces at 8 and 1 samples gives the traced 4 and 2."""
    if model == "gpt":
        build, batch = (lambda: GPTLightningModule(**GPT)), _tokens(8)
    else:
        from tests.distributed.hf_models import HFLightningModule

        build = lambda: HFLightningModule("llama")  # noqa: E731
        tokens = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
        batch = (tokens, tokens)
    first = trace_step(build, batch)
    anchors = {8: first, 1: trace_step(build, _first(batch, 1), state_per_element=first.state_per_element)}
    for micro in (4, 2):
        traced = trace_step(build, _first(batch, micro))
        line = on_the_line(anchors[8], anchors[1], micro)
        assert line is not None
        assert line.timeline == traced.timeline and line.batch_size == micro
        assert line.state_per_element == traced.state_per_element


def _first(batch, size):
    return tuple(t[:size] for t in batch)


def test_choose_keeps_what_was_given():
    budget = Budget(22 * MIB, 0.1, 4 * 2**30, "device_memory")
    free = choose(_planner(), budget, _arguments(), set(), split=True)
    assert free.splits > 1  # left open, the tight budget splits the batch
    no_ck = choose(
        _planner(), budget, _arguments(activation_checkpointing=None), {"activation_checkpointing"}, split=True
    )
    assert not no_ck.settings["activation_checkpointing"] and no_ck.splits > 1
    kept = choose(
        _planner(),
        budget,
        _arguments(offload_optimizer=False, offload_activations=False),
        {"offload_optimizer", "offload_activations"},
        split=False,
    )
    assert not kept.settings["offload_optimizer"] and kept.settings["activation_checkpointing"]
    delayed = choose(
        _planner(),
        Budget(1e9, 0.1, 4 * 2**30, "x"),
        _arguments(offload_optimizer=True, offload_step_delay=1),
        {"offload_optimizer", "offload_step_delay"},
        split=True,
    )  # the delayed update needs stage 1 or 2 with the whole optimizer offloaded
    assert delayed.settings["stage"] in (1, 2) and delayed.settings["offload_optimizer"] is True


def test_settings_given_that_leave_nothing_to_choose_are_named():
    with pytest.raises(ZeroConfigError, match="leave no stage to choose from"):
        choose(
            _planner(),
            Budget(1e9, 0.1, 4 * 2**30, "x"),
            _arguments(offload_params=True, offload_step_delay=1, offload_optimizer=True),
            {"offload_params", "offload_step_delay", "offload_optimizer"},
            split=True,
        )


def test_a_cpu_run_without_device_memory_weighs_no_offload():
    """The host is the device: offloading moves nothing out of the memory the budget counts."""
    choice = choose(_planner(), Budget(16 * MIB, 0.1, None, "host"), _arguments(), set(), split=True)
    assert not choice.settings["offload_optimizer"] and not choice.settings["offload_activations"]
    with pytest.raises(NothingFits, match=r"found no configuration for 4\.00 MiB per device"):
        choose(_planner(), Budget(4 * MIB, 0.1, None, "host"), _arguments(), set(), split=True)


def test_a_choice_survives_its_checkpoint_record():
    choice = choose(_planner(), Budget(22 * MIB, 0.1, 4 * 2**30, "x"), _arguments(), set(), split=True)
    again = AutoChoice.from_record(choice.record())
    assert dataclasses.replace(again, table=choice.table) == choice
    assert "micro-batch" in again.describe() and "predicted peak" in again.describe()


def test_relative_time_of_a_candidate_is_the_documented_estimate():
    stage3 = CONFIGURATIONS[2]
    assert relative_time(stage3, True, False, 4) == pytest.approx(1.12 * 4 / 3 * (1 + 0.1 * 2))


def test_batches_split_where_their_tensors_share_a_first_dimension():
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    assert splittable(x) and splittable((x, y)) and splittable({"a": x, "b": [y, {"c": y}]})
    assert not splittable((x, torch.arange(3)))  # first dimensions differ
    assert not splittable((x, ["a", "b", "c", "d", "e"]))  # strings
    assert not splittable(torch.tensor(1.0))  # no batch dimension
    parts = split({"a": x, "b": (y,)}, 2)
    assert [p["b"][0].tolist() for p in parts] == [[0, 1], [2, 3], [4]]  # the last part shorter
    assert torch.equal(torch.cat([p["a"] for p in parts]), x)


def test_repeated_block_is_the_first_module_lists_layer():
    module = GPTLightningModule(**GPT)
    assert repeated_block(module) is Block
    assert repeated_block(torch.nn.Linear(2, 2)) is None


class Normalized(L.LightningModule):
    """``BatchNorm1d`` on ``(B, C)``: its training step fails at one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(8, 8000), torch.nn.BatchNorm1d(8000), torch.nn.ReLU())

    def training_step(self, batch, batch_idx):
        return self.layers(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_a_micro_batch_the_step_cannot_run_at_is_not_weighed():
    """The line's anchor at 1 sample fails for ``BatchNorm1d``: the micro-batches between are traced on their own,
    and 1 is no candidate, where the step runs at 4."""
    from lightning_zero.planning.plan import MicroBatchFails
    from lightning_zero.planning.predict import Configuration

    planner = Planner(Normalized, (torch.randn(8, 8),), world_size=2, backend="gloo")
    with pytest.raises(MicroBatchFails, match="at 1 samples"):
        planner.trace(1, False)
    whole, half = (planner.candidate(Configuration(1), False, m).prediction.device_bytes for m in (8, 4))
    pick = planner.search((whole + half) / 2, configurations=[Configuration(1)]).pick
    assert pick.micro_batch == 4 and (4, False, False) in planner._traces
