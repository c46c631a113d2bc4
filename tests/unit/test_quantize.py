"""Block-wise quantization codecs and error feedback, without processes."""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from lightning_zero.engine.comm.quantize import BITS, SCHEMES, Codec, ErrorFeedback

CODECS = [Codec(bits=b, block_size=256, scheme=s) for b, s in itertools.product(BITS, SCHEMES)]
IDS = [f"{c.scheme}-{c.bits}" for c in CODECS]
EPS = torch.finfo(torch.float32).eps


def _blocks(x: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    return list(x.float().split(block_size))


def _reference_scale(block: torch.Tensor, codec: Codec) -> float:
    """The step of one block, computed here from its own values rather than read from the codec."""
    if codec.scheme == "symmetric":
        return block.abs().max().item() / (2 ** (codec.bits - 1) - 1)
    return (block.max() - block.min()).item() / (2**codec.bits - 1)


def _mixed_magnitudes(numel: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """Normal data whose blocks differ by up to six orders of magnitude, so a global bound would hide per-block ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    for i, start in enumerate(range(0, numel, block_size)):
        x[start : start + block_size] *= 10.0 ** ((i % 7) - 3)
    x[block_size : 2 * block_size] += 50.0  # an offset block: asymmetric's zero point matters here
    last = (numel - 1) // block_size * block_size
    x[last:] = x[last:].abs() + 5.0  # all positive: padding the partial last block with zeros would widen its range
    return x


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_round_trip_error_is_within_half_a_step_of_each_block(codec):
    numel = 11 * codec.block_size + 37
    x = _mixed_magnitudes(numel, codec.block_size)
    y = codec.decode(codec.encode(x), numel)
    assert y.shape == (numel,) and y.dtype == torch.float32
    for i, (xb, yb) in enumerate(zip(_blocks(x, codec.block_size), _blocks(y, codec.block_size))):
        scale = _reference_scale(xb, codec)
        slack = 4 * EPS * xb.abs().max().item()  # fp32 rounding of the decode's multiply-add
        err = (xb - yb).abs().max().item()
        assert err <= scale / 2 + slack, f"block {i}: error {err} > half of its step {scale}"
    assert (x - y).abs().max() > 0  # the bound above is not vacuous


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_encode_leaves_its_input_alone(codec):
    for numel in (2 * codec.block_size, 2 * codec.block_size + 1):  # fp32 whole blocks are worked on without a copy
        x = torch.randn(numel)
        before = x.clone()
        codec.encode(x)
        assert torch.equal(x, before)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_block_extremes_survive(codec):
    x = _mixed_magnitudes(3 * codec.block_size, codec.block_size, seed=1)
    y = codec.decode(codec.encode(x), x.numel())
    for xb, yb in zip(_blocks(x, codec.block_size), _blocks(y, codec.block_size)):
        tol = 4 * EPS * xb.abs().max().item()
        if codec.scheme == "asymmetric":
            for pick in (torch.argmin, torch.argmax):
                i = pick(xb)
                assert abs(yb[i] - xb[i]) <= tol
        else:
            i = torch.argmax(xb.abs())
            assert abs(yb[i] - xb[i]) <= tol


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_zeros_constants_and_tiny_sizes_decode_exactly(codec):
    bs = codec.block_size
    zeros = torch.zeros(2 * bs + 5)
    y = codec.decode(codec.encode(zeros), zeros.numel())
    assert torch.equal(y, zeros)

    consts = torch.cat([torch.full((bs,), v) for v in (0.1, -3.7, 0.0, 1e-20)] + [torch.full((9,), 123.25)])
    y = codec.decode(codec.encode(consts), consts.numel())
    if codec.scheme == "asymmetric":
        assert torch.equal(y, consts)
    else:  # q = +-qmax, and qmax * (c / qmax) is c up to fp32 rounding
        torch.testing.assert_close(y, consts, rtol=2 * EPS, atol=0)

    empty = torch.empty(0)
    packed = codec.encode(empty)
    assert packed.numel() == codec.packed_nbytes(0) == 0
    assert codec.decode(packed, 0).numel() == 0

    one = torch.tensor([-2.5])
    y = codec.decode(codec.encode(one), 1)
    assert torch.equal(y, one) if codec.scheme == "asymmetric" else torch.allclose(y, one, rtol=2 * EPS, atol=0)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_low_precision_inputs_and_outputs(codec):
    numel = 3 * codec.block_size + 10
    x = _mixed_magnitudes(numel, codec.block_size, seed=2)
    for dtype in (torch.bfloat16, torch.float16):
        low = x.clamp(-6e4, 6e4).to(dtype)
        assert torch.equal(codec.encode(low), codec.encode(low.float()))  # arithmetic is fp32 either way

    packed = codec.encode(x)
    ref = codec.decode(packed, numel)
    out = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
    assert codec.decode(packed, numel, out=out) is out
    assert torch.equal(out, ref.to(torch.bfloat16))
    assert torch.equal(codec.decode(packed, numel, dtype=torch.bfloat16), ref.to(torch.bfloat16))

    exact = x[: 2 * codec.block_size]  # whole blocks: decoded straight into an fp32 out
    out32 = torch.empty_like(exact)
    assert codec.decode(codec.encode(exact), exact.numel(), out=out32) is out32
    assert torch.equal(out32, ref[: exact.numel()])


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_packed_size_depends_on_numel_only_and_keeps_scales_aligned(codec):
    bs = codec.block_size
    for numel in (0, 1, bs - 1, bs, bs + 1, 5 * bs + 3):
        sizes = {codec.encode(torch.randn(numel) * s).numel() for s in (1e-3, 1.0, 1e3)}
        assert sizes == {codec.packed_nbytes(numel)}
        assert codec.packed_nbytes(numel) % 4 == 0

    # all_gather-style: equal chunks concatenate, and every chunk decodes in place from the gathered buffer.
    chunks = [torch.randn(bs + 3) for _ in range(3)]
    n = codec.packed_nbytes(bs + 3)
    gathered = torch.empty(3 * n, dtype=torch.uint8)
    for r, c in enumerate(chunks):
        assert codec.encode(c, out=gathered[r * n : (r + 1) * n]).data_ptr() == gathered.data_ptr() + r * n
    for r, c in enumerate(chunks):
        alone = codec.decode(codec.encode(c), c.numel())
        assert torch.equal(codec.decode(gathered[r * n : (r + 1) * n], c.numel()), alone)
    odd = torch.empty(n + 1, dtype=torch.uint8)[1:]  # a buffer off a 4-byte boundary still decodes (via a copy)
    odd.copy_(gathered[:n])
    assert torch.equal(codec.decode(odd, chunks[0].numel()), codec.decode(gathered[:n], chunks[0].numel()))


@pytest.mark.parametrize("bits,ratio", [(8, 0.26), (4, 0.13)])
def test_packed_ratio_for_default_blocks(bits, ratio):
    numel = 2048 * 1000
    for scheme in SCHEMES:
        codec = Codec(bits=bits, block_size=2048, scheme=scheme)
        assert codec.packed_nbytes(numel) <= ratio * 4 * numel


def test_four_bit_wire_format():
    codec = Codec(bits=4, block_size=2)
    packed = codec.encode(torch.tensor([1.0, -1.0]))  # scale 1/7, q = (7, -7)
    assert packed.numel() == 8  # one payload byte padded to 4, then one fp32 scale
    assert packed[0].item() == (7 & 0x0F) | ((-7 & 0x0F) << 4)  # element 0 in the low nibble
    assert packed[4:].view(torch.float32).item() == pytest.approx(1 / 7)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_block_decodes_to_nan_and_leaves_others_alone(codec, bad):
    bs = codec.block_size
    x = torch.randn(4 * bs + 7)
    clean = codec.decode(codec.encode(x), x.numel())
    x[bs + 5] = bad
    y = codec.decode(codec.encode(x), x.numel())
    assert torch.isnan(y[bs : 2 * bs]).all()
    assert torch.equal(y[:bs], clean[:bs]) and torch.equal(y[2 * bs :], clean[2 * bs :])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"bits": 3}, r"Codec\.bits must be one of \(4, 8\), got 3"),
        ({"scheme": "foo"}, r"Codec\.scheme must be one of \('symmetric', 'asymmetric'\), got 'foo'"),
        ({"block_size": 0}, r"Codec\.block_size must be an integer >= 1.*got 0"),
        ({"bits": 4, "block_size": 3}, r"Codec\.block_size .*even when bits=4.*got 3"),
    ],
)
def test_codec_rejects_bad_fields_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Codec(**kwargs)


def test_buffers_of_the_wrong_size_are_rejected():
    codec = Codec()
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8 tensor of"):
        codec.encode(torch.randn(10), out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed must be"):
        codec.decode(torch.empty(3, dtype=torch.uint8), 10)
    with pytest.raises(ValueError, match="1-D floating"):
        codec.encode(torch.randn(2, 3))


def _gradients(steps: int, numel: int, seed: int = 0):
    """A fixed pattern, a little noise and a small constant bias: plain quantization rounds nearly the same way every
    step, so what it drops adds up linearly."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(numel, generator=g)
    for _ in range(steps):
        yield base + 1e-3 * torch.randn(numel, generator=g) + 2e-3


def test_error_feedback_keeps_the_running_sum_within_one_step():
    codec = Codec(bits=8, block_size=256)
    numel, steps = 16 * 256 + 40, 200
    ef = ErrorFeedback(codec)
    sent = sent_plain = true = torch.zeros(numel, dtype=torch.float64)
    for x in _gradients(steps, numel):
        true = true + x.double()
        sent = sent + codec.decode(ef.encode(7, x), numel).double()
        sent_plain = sent_plain + codec.decode(codec.encode(x), numel).double()
        residual = ef.state_dict()["7"].double()
        torch.testing.assert_close(sent - true, -residual, rtol=0, atol=5e-5)
        step = max(_reference_scale(b, codec) for b in _blocks(x, codec.block_size))
        # Half a step (of the compensated block, a hair wider than x's), every step: no growth with the count.
        assert residual.abs().max() <= 0.55 * step
    drift_ef = (sent - true).abs().max().item()
    drift_plain = (sent_plain - true).abs().max().item()
    assert drift_plain > 10 * drift_ef, (drift_plain, drift_ef)
    assert ef.residual_bytes() == numel * 4


def test_error_feedback_state_dict_round_trip_reproduces_the_next_encode():
    codec = Codec(bits=4, block_size=64, scheme="asymmetric")
    a = ErrorFeedback(codec)
    grads = list(_gradients(6, 1000))
    for x in grads[:5]:
        a.encode((2, 1), x)
        a.encode(3, x[:300].to(torch.bfloat16))
    state = a.state_dict()
    assert sorted(state) == ["2.1", "3"]
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    b = ErrorFeedback(codec)
    b.load_state_dict(torch.load(buf))
    assert b.residual_bytes() == a.residual_bytes() == 1300 * 4
    assert torch.equal(a.encode((2, 1), grads[5]), b.encode((2, 1), grads[5]))
    assert torch.equal(a.encode(3, grads[5][:300]), b.encode(3, grads[5][:300]))
    assert torch.equal(a.state_dict()["2.1"], b.state_dict()["2.1"])

    with pytest.raises(ValueError, match="holds 300 elements"):
        a.encode(3, grads[0])
    a.reset()
    assert a.residual_bytes() == 0 and a.state_dict() == {}
    assert torch.equal(a.encode(3, grads[0]), codec.encode(grads[0]))  # fresh residual: plain quantization


def test_error_feedback_overflow_step_does_not_poison_later_steps():
    codec = Codec(bits=8, block_size=128)
    ef = ErrorFeedback(codec)
    x = torch.randn(512)
    ef.encode("g", x)
    bad = x.clone()
    bad[3] = float("inf")
    assert torch.isnan(codec.decode(ef.encode("g", bad), 512)[:128]).all()  # the loss scaler sees the overflow
    assert torch.isfinite(ef.state_dict()["g"]).all()
    assert torch.isfinite(codec.decode(ef.encode("g", x), 512)).all()
