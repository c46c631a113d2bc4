"""Which parameters a mixed policy holds in fp32, and the extra stage-3 units that keep one dtype per unit (under a
mixed policy, and for a model built in several dtypes)."""

import pytest
import torch
from torch import nn

from lightning_zero.engine.mixed_precision import PrecisionPolicy, mixed_state_bytes
from lightning_zero.engine.stage3.fsdp2_units import one_dtype_units, select_units, units_of_one_dtype, whole_params

POLICY = PrecisionPolicy(torch.bfloat16, torch.bfloat16)


class GainBlock(nn.Module):
    """Owns a gain vector itself and a Linear: the Linear must become a unit of its own at stage 3."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)


class Tied(nn.Module):
    """An embedding tied to a head whose bias is owned by a vector-only parent (BERT's prediction head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Module()
        self.head.decoder = nn.Linear(4, 8)
        self.head.bias = self.head.decoder.bias
        self.head.decoder.weight = self.embed.weight


def names(module, ids):
    return sorted(n for n, m in module.named_modules() if id(m) in ids)


def test_vector_only_layers_are_fp32_whatever_their_class():
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.LayerNorm(4),
        nn.GroupNorm(2, 4),
        nn.RMSNorm(4),
        nn.Embedding(3, 4),
        nn.Conv1d(4, 4, 1),
        nn.BatchNorm1d(4),
        GainBlock(),
    )
    dtypes = {n: POLICY.param_dtypes(model)[id(p)] for n, p in model.named_parameters()}
    fp32 = sorted(n for n, d in dtypes.items() if d == torch.float32)
    assert fp32 == [
        "1.bias",
        "1.weight",
        "2.bias",
        "2.weight",
        "3.weight",
        "6.bias",
        "6.weight",
        "7.gain",
        "7.norm.bias",
        "7.norm.weight",
    ]
    assert dtypes["0.bias"] == torch.bfloat16, "a Linear's bias goes through autocast's cast with its weight"
    assert dtypes["4.weight"] == torch.bfloat16


def test_fp32_modules_extends_the_rule():
    policy = PrecisionPolicy(torch.bfloat16, torch.bfloat16, fp32_modules=(nn.Embedding,))
    assert policy.param_dtypes(nn.Embedding(3, 4)).popitem()[1] == torch.float32


class SelfCastingRouter(nn.Module):
    """Hugging Face's Switch Transformers router: declares fp32 and casts its classifier to it in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(4, 2, bias=False)
        self.dtype = torch.float32


def test_a_layer_listed_or_declaring_fp32_holds_everything_beneath_it_in_fp32():
    block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model = nn.Sequential(nn.Linear(4, 4), SelfCastingRouter(), block)
    fp32 = sorted(n for n, p in model.named_parameters() if POLICY.param_dtypes(model)[id(p)] == torch.float32)
    assert fp32 == ["1.classifier.weight", "2.1.bias", "2.1.weight"]
    listed = PrecisionPolicy(torch.bfloat16, torch.bfloat16, fp32_modules=(nn.Sequential,))
    assert set(listed.param_dtypes(block).values()) == {torch.float32}  # the listed container's Linear too
    bound = POLICY.bound_to(model)  # stage 3 asks module by module: the classifier becomes an fp32 unit of its own
    assert bound.holds_fp32(model[1].classifier) and not POLICY.holds_fp32(model[1].classifier)
    assert not bound.holds_fp32(model[1]) and not bound.holds_fp32(model[0])
    assert names(model, one_dtype_units(model, [model[2]], bound.holds_fp32)) == ["1.classifier", "2.1"]


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_the_inputs_of_a_reparametrized_weight_are_fp32_and_its_parametrization_an_fp32_unit():
    """Weight and spectral norms compute the weight (norms, a power iteration beside fp32 buffers) before the Linear
    sees it: their parameters are held in fp32, as autocast leaves them, and so is each Linear's bias (its only own
    parameter beside a ``ParametrizationList``; the hooked layer's own beside ``weight_g``/``weight_v``)."""
    model = nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)),
        nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)),
        nn.utils.weight_norm(nn.Linear(4, 4)),
        nn.utils.spectral_norm(nn.Linear(4, 4)),
        nn.Linear(4, 4),
    )
    dtypes = {n: POLICY.param_dtypes(model)[id(p)] for n, p in model.named_parameters()}
    fp32 = sorted(n for n, d in dtypes.items() if d == torch.float32)
    assert fp32 == [
        "0.bias",
        "0.parametrizations.weight.original",
        "1.bias",
        "1.parametrizations.weight.original0",
        "1.parametrizations.weight.original1",
        "2.bias",
        "2.weight_g",
        "2.weight_v",
        "3.bias",
        "3.weight_orig",
    ]
    assert dtypes["4.weight"] == dtypes["4.bias"] == torch.bfloat16
    assert names(model, one_dtype_units(model, [], POLICY.holds_fp32)) == ["0", "1", "2", "3"]  # fp32 units, at stage 3


def test_tied_parameters_follow_the_matrix_layer_and_stay_in_one_unit():
    model = Tied()
    dtypes = POLICY.param_dtypes(model)
    assert dtypes[id(model.head.bias)] == torch.bfloat16
    assert one_dtype_units(model, select_units(model, None), POLICY.holds_fp32) == set()


def test_stage3_units_hold_one_dtype_each():
    model = nn.Module()
    model.blocks = nn.ModuleList([GainBlock(), GainBlock()])
    units = select_units(model, None)
    extra = one_dtype_units(model, units, POLICY.holds_fp32)
    # The blocks own a gain vector, so they are fp32 units; their LayerNorms share that dtype, their Linears not.
    assert names(model, extra) == ["blocks.0.proj", "blocks.1.proj"]
    plain = nn.Module()
    plain.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(2)])
    assert names(plain, one_dtype_units(plain, select_units(plain, None), POLICY.holds_fp32)) == [
        "blocks.0.0",
        "blocks.1.0",
    ]


def test_a_model_built_in_two_dtypes_gets_one_unit_per_dtype_and_merges_only_alike_units():
    """No policy (``32-true``): a bf16 Linear inside an fp32 block becomes a unit of its own; the kind units merge by is
    the dtype their own parameters are held in (the model's main dtype where they hold none)."""
    model = nn.Module()
    model.blocks = nn.ModuleList(
        [nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 4)) for _ in range(2)]
    )
    model.head = nn.Linear(4, 2).to(torch.float64)
    units, kind = units_of_one_dtype([model], select_units(model, None), None)
    assert sorted(names(model, {id(u) for u in units})) == ["blocks.0", "blocks.0.1", "blocks.1", "blocks.1.1", "head"]
    assert [kind(m) for m in (model.blocks[0], model.blocks[0][1], model.head)] == [
        torch.float32,
        torch.bfloat16,
        torch.float64,
    ]


def test_a_layer_holding_two_dtypes_itself_is_refused_at_stage_3_naming_the_unit():
    model = nn.Module()
    model.block = nn.Linear(4, 4)
    model.block.scale = nn.Parameter(torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"unit 'block' holds parameters in float32 and float64.*stage 1 or 2"):
        units_of_one_dtype([model], select_units(model, None), None)
    units_of_one_dtype([model], select_units(model, None), POLICY)  # a mixed policy casts each unit to one dtype


def test_integer_and_0_dim_parameters_stay_whole_and_take_no_part_in_a_units_dtype():
    model = nn.Module()
    model.block = nn.Linear(4, 4)
    model.block.qweight = nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    model.codes = nn.Parameter(torch.arange(4), requires_grad=False)
    model.temperature = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
    model.index_only = nn.Module()
    model.index_only.table = nn.Parameter(torch.arange(3), requires_grad=False)
    units, kind = units_of_one_dtype([model], select_units(model, None), None)
    assert names(model, {id(u) for u in units}) == ["block"]  # a child holding only integers is no unit
    assert kind(model.block) == torch.float32
    assert whole_params([model]) == {model.block.qweight, model.codes, model.temperature, model.index_only.table}


def test_state_bytes_formulas():
    assert mixed_state_bytes(100, 0, 2, 1) == {"device": 4 * 100 + 12 * 50, "host": 0.0}
    assert mixed_state_bytes(100, 0, 2, 2) == {"device": 2 * 100 + 14 * 50, "host": 0.0}
    assert mixed_state_bytes(100, 10, 2, 3) == {"device": 16 * 55, "host": 0.0}
    assert mixed_state_bytes(100, 10, 2, 3, offload=True) == {"device": 0.0, "host": 16 * 55}
    # fp32-held parameters cost their fp32 bytes plus master rows
    assert mixed_state_bytes(0, 10, 2, 1)["device"] == 8 * 10 + 12 * 5
