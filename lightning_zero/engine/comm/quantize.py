"""Block-wise quantization that shrinks what collectives move (ZeRO++'s qwZ for weights, qgZ for gradients).

[Note: packed layout]
A flat tensor of ``numel`` elements travels as one ``uint8`` buffer::

    [ payload: int{bits} per element, padded to whole blocks, then to a multiple of 4 bytes
    | scales: one fp32 per block
    | zero points: one fp32 per block (asymmetric only) ]

The size is a function of ``numel`` alone, so equal-numel chunks give equal-size buffers that the collectives can move
as equal chunks. Every section starts at a multiple of 4 bytes and the total is one too, so the fp32 sections of any
chunk of such a concatenation can be read with ``Tensor.view(torch.float32)`` without a copy.

Non-finite inputs are not hidden: a block holding ``inf`` or ``nan`` gets a NaN scale and decodes to all NaN, so a loss
scaler's overflow check after the collective still sees the overflow.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Hashable

import torch
from torch import Tensor

SCHEMES = ("symmetric", "asymmetric")  # DeepSpeed's symmetric_quantization_signed / asymmetric_quantization_signed
BITS = (4, 8)


@dataclasses.dataclass(frozen=True)
class Codec:
    """See [Note: packed layout]. Small blocks follow outliers more closely at the price of more scale bytes."""

    bits: int = 8
    block_size: int = 2048
    scheme: str = "symmetric"

    def __post_init__(self) -> None:
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise ValueError(f"Codec.bits must be one of {BITS}, got {self.bits!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"Codec.scheme must be one of {SCHEMES}, got {self.scheme!r}")
        size = self.block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1 or (self.bits == 4 and size % 2):
            raise ValueError(
                "Codec.block_size must be an integer >= 1 (and even when bits=4, two values share a byte), "
                f"got {size!r}"
            )

    # -- sizes -------------------------------------------------------------------------------------------------------

    @property
    def _asymmetric(self) -> bool:
        return self.scheme == "asymmetric"

    def _n_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def _payload_nbytes(self, n_blocks: int) -> int:
        padded = n_blocks * self.block_size
        nbytes = padded if self.bits == 8 else padded // 2
        return -(-nbytes // 4) * 4  # keeps the fp32 sections 4-byte aligned

    def packed_nbytes(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        n_blocks = self._n_blocks(numel)
        return self._payload_nbytes(n_blocks) + 4 * n_blocks * (2 if self._asymmetric else 1)

    # -- encode ------------------------------------------------------------------------------------------------------

    def encode(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if x.dim() != 1 or not x.is_floating_point():
            raise ValueError(f"encode expects a 1-D floating tensor, got {x.dtype} of shape {tuple(x.shape)}")
        numel = x.numel()
        nbytes = self.packed_nbytes(numel)
        if out is None:
            out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        else:
            _check_bytes("out", out, nbytes)
        if numel == 0:
            return out
        n_blocks = self._n_blocks(numel)
        blocks = self._blocks(x, n_blocks)
        owned = blocks.data_ptr() != x.data_ptr()  # a copy of x can be overwritten in place
        lo, hi = torch.aminmax(blocks, dim=1)
        qmax = (1 << (self.bits - 1)) - 1
        if self._asymmetric:
            # hi/L - lo/L rather than (hi - lo)/L: the difference of two finite fp32 values can overflow.
            levels = (1 << self.bits) - 1
            scale = hi / levels - lo / levels
            qmin = -(qmax + 1)
            q = blocks.sub_(lo[:, None]) if owned else blocks - lo[:, None]
        else:
            scale = torch.maximum(hi, -lo) / qmax
            qmin = -qmax
            q = blocks
        bad = ~torch.isfinite(scale)
        scale = scale.masked_fill(bad, float("nan"))
        # A zero scale (all-zero or constant block) divides by one instead; q is then 0 (or qmin) and decodes exactly.
        divisor = torch.where(scale == 0, 1.0, scale)[:, None]
        q = q.div_(divisor) if owned or self._asymmetric else q / divisor
        q.round_()
        if self._asymmetric:
            q.add_(qmin)
        q.clamp_(qmin, qmax)
        self._store_payload(q, out, n_blocks)
        payload = self._payload_nbytes(n_blocks)
        out[payload : payload + 4 * n_blocks].copy_(scale.view(torch.uint8))
        if self._asymmetric:
            zero = lo.masked_fill(bad, float("nan"))
            out[payload + 4 * n_blocks :].copy_(zero.view(torch.uint8))
        return out

    def _blocks(self, x: Tensor, n_blocks: int) -> Tensor:
        """``x`` as fp32 ``[n_blocks, block_size]``; the padding repeats the last block's first element, which lies
        inside that block's range and so leaves its scale as the unpadded part's."""
        numel, padded = x.numel(), n_blocks * self.block_size
        if numel == padded:
            return x.contiguous().to(torch.float32).view(n_blocks, self.block_size)
        buf = torch.empty(padded, dtype=torch.float32, device=x.device)
        buf[:numel].copy_(x)
        buf[numel:].copy_(buf[(n_blocks - 1) * self.block_size].expand(padded - numel))
        return buf.view(n_blocks, self.block_size)

    def _store_payload(self, q: Tensor, out: Tensor, n_blocks: int) -> None:
        padded = n_blocks * self.block_size
        payload = out.view(torch.int8)
        if self.bits == 8:
            payload[:padded].view(n_blocks, self.block_size).copy_(q)
            return
        pairs = q.to(torch.int8).view(-1, 2)  # element 2i in the low nibble, 2i + 1 in the high one
        payload[: padded // 2].copy_(torch.bitwise_or(pairs[:, 0] & 0x0F, pairs[:, 1] << 4))

    # -- decode ------------------------------------------------------------------------------------------------------

    def decode(
        self, packed: Tensor, numel: int, dtype: torch.dtype = torch.float32, out: Tensor | None = None
    ) -> Tensor:
        """Inverse of :meth:`encode`; the dtype of ``out``, where given, wins over ``dtype``."""
        _check_bytes("packed", packed, self.packed_nbytes(numel))
        if out is not None:
            if out.dim() != 1 or out.numel() != numel or not out.is_floating_point():
                raise ValueError(
                    f"out must be a 1-D floating tensor of {numel} elements, "
                    f"got {out.dtype} of shape {tuple(out.shape)}"
                )
            dtype = out.dtype
        if numel == 0:
            return out if out is not None else torch.empty(0, dtype=dtype, device=packed.device)
        n_blocks = self._n_blocks(numel)
        padded = n_blocks * self.block_size
        fits = out is not None and out.dtype == torch.float32 and out.is_contiguous() and numel == padded
        direct = out if fits else None
        shape = (n_blocks, self.block_size)
        work = torch.empty(shape, dtype=torch.float32, device=packed.device) if direct is None else direct.view(shape)
        work.copy_(self._load_payload(packed, n_blocks))
        payload = self._payload_nbytes(n_blocks)
        scale = _as_float32(packed[payload : payload + 4 * n_blocks])[:, None]
        if self._asymmetric:
            zero = _as_float32(packed[payload + 4 * n_blocks :])[:, None]
            work.add_(1 << (self.bits - 1)).mul_(scale).add_(zero)
        else:
            work.mul_(scale)
        if direct is not None:
            return direct
        flat = work.view(-1)[:numel]
        if out is not None:
            return out.copy_(flat)
        return flat if dtype == torch.float32 else flat.to(dtype)

    def _load_payload(self, packed: Tensor, n_blocks: int) -> Tensor:
        padded = n_blocks * self.block_size
        payload = packed.view(torch.int8)
        if self.bits == 8:
            return payload[:padded].view(n_blocks, self.block_size)
        both = payload[: padded // 2]
        low = torch.bitwise_left_shift(both, 4).bitwise_right_shift_(4)  # arithmetic shifts sign-extend the nibble
        return torch.stack((low, both >> 4), dim=1).view(n_blocks, self.block_size)


def _check_bytes(name: str, t: Tensor, nbytes: int) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() != nbytes or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D uint8 tensor of {nbytes} bytes, got {t.dtype} of shape {tuple(t.shape)}"
        )


def _as_float32(section: Tensor) -> Tensor:
    """Copies only when a caller's buffer starts off a 4-byte boundary."""
    if section.storage_offset() % 4:
        section = section.clone()
    return section.view(torch.float32)


def _key_name(key: Hashable) -> str:
    if isinstance(key, tuple):
        return ".".join(_key_name(k) for k in key)
    return str(key)


class ErrorFeedback:
    """See [Note: error feedback] in ``compression.py``. Residuals are kept under string names (``(2, 1)`` -> ``"2.1"``)
    so a checkpoint's :meth:`state_dict` is found again by the same keys."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residuals: dict[str, Tensor] = {}
        self._restored: set[str] = set()  # loaded from a checkpoint and not used since: a size change is not a bug

    def encode(self, key: Hashable, x: Tensor, out: Tensor | None = None, codec: Codec | None = None) -> Tensor:
        """``codec.encode(x + residual)``, keeping the new residual for the next call."""
        codec = codec or self.codec
        if x.dim() != 1:
            raise ValueError(f"error feedback expects a 1-D tensor, got shape {tuple(x.shape)}")
        name = _key_name(key)
        residual = self._residuals.get(name)
        if residual is None:
            residual = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        elif residual.numel() != x.numel():
            if name not in self._restored:
                raise ValueError(f"error feedback key {name!r} holds {residual.numel()} elements, got {x.numel()}")
            warnings.warn(
                f"error feedback residual {name!r} from the checkpoint holds {residual.numel()} elements, "
                f"this run's chunk {x.numel()}: it starts from zero.",
                stacklevel=2,
            )
            residual = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        elif residual.device != x.device:
            residual = residual.to(x.device)
        self._restored.discard(name)
        compensated = torch.add(x, residual)
        packed = codec.encode(compensated, out)
        codec.decode(packed, x.numel(), out=residual)
        torch.sub(compensated, residual, out=residual)
        # An overflowed step (NaN block) is skipped by the loss scaler; keeping its NaN would poison every later step.
        residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self._residuals[name] = residual
        return packed

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self._residuals)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        residuals = {}
        for name, value in state.items():
            if not isinstance(value, Tensor) or not value.is_floating_point():
                raise ValueError(f"error feedback residual {name!r} must be a floating tensor")
            residuals[str(name)] = value.detach().reshape(-1).to(torch.float32).contiguous()
        self._residuals = residuals
        self._restored = set(residuals)

    def residual_bytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def reset(self) -> None:
        self._residuals.clear()
