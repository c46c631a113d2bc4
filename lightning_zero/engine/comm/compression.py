"""Compressed collectives: smaller payloads on the wire, fp32 arithmetic at both ends (ZeRO++ qgZ and qwZ, and
16-bit transport).

The gradient reduce-scatter (qgZ) runs as one all-to-all of encoded chunks, each owner decoding and summing in fp32: a
quantized reduce-scatter cannot run as a ring, since every hop would sum and re-quantize, compounding the error. The sum
across replica groups and the parameter all-gather (qwZ) are all-gathers of encoded rows.

[Note: whose values are decoded]
Replicas must compute with the same numbers. A sum that only the owner computes (the reduce-scatter's) may use the
owner's own chunk exactly: it never travels, and stage 1's own rows hold the running sum of earlier backwards, which
must not be re-quantized. A result that every rank computes (the replica sum, the gathered parameters) is decoded from
the same bytes everywhere, a rank's own encoding included; otherwise each rank would keep its own rows exact and its
peers' rounded, and the replicas would drift apart. The exact values live on in the fp32 master rows.

[Note: error feedback]
With ``error_feedback`` each rank keeps, per chunk it sends, what quantization dropped last time, and adds it to the
next gradient of that chunk (EF-SGD, as 1-bit Adam does), so the applied gradients track the true sum instead of
drifting. Residuals are named by the peer's offset from this rank, not by the peer's rank, so every rank of a run has
the same names (see ``checkpoint/error_feedback.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_zero.engine.comm import collectives
from lightning_zero.engine.comm.quantize import Codec, ErrorFeedback

_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class CompressionSpec:
    gradients: str | None = None
    params: str | None = None
    scheme: str = "symmetric"
    block_size: int = 2048
    error_feedback: bool = False
    inter_node_only: bool = False
    """Hybrid sharding: compress only the sum across replica groups, the traffic between nodes."""

    @property
    def enabled(self) -> bool:
        return self.gradients is not None or self.params is not None


class _Cast:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def buffer(self, rows: int, numel: int, device: torch.device) -> torch.Tensor:
        return torch.empty(rows, numel, dtype=self.dtype, device=device)

    def encode(self, x: torch.Tensor, out: torch.Tensor, feedback: ErrorFeedback | None, key: object) -> None:
        out.copy_(x)

    def decode(self, row: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(row)


class _Quantized:
    """Block-wise int8/int4 with fp32 scales (``quantize.py``), blocks no larger than a chunk: a small chunk would
    otherwise travel as a whole padded block."""

    def __init__(self, bits: int, block_size: int, scheme: str) -> None:
        self.bits, self.block_size, self.scheme = bits, block_size, scheme

    @functools.lru_cache(maxsize=None)
    def codec(self, numel: int) -> Codec:
        """Blocks evened out over the chunk: 6240 elements in blocks of at most 2048 travel as 4 blocks of 1560, not 3
        of 2048 and a padded fourth."""
        blocks = max(1, -(-numel // self.block_size))
        block = -(-numel // blocks)
        return Codec(bits=self.bits, block_size=max(2, block + block % 2), scheme=self.scheme)

    def buffer(self, rows: int, numel: int, device: torch.device) -> torch.Tensor:
        return torch.empty(rows, self.codec(numel).packed_nbytes(numel), dtype=torch.uint8, device=device)

    def encode(self, x: torch.Tensor, out: torch.Tensor, feedback: ErrorFeedback | None, key: object) -> None:
        codec = self.codec(x.numel())
        if feedback is None:
            codec.encode(x, out)
        else:
            feedback.encode(key, x, out, codec=codec)

    def decode(self, row: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
        return self.codec(numel).decode(row, numel, out=out)


@functools.lru_cache(maxsize=None)
def _transport(wire: str | None, spec: CompressionSpec, dtype: torch.dtype) -> _Cast | _Quantized | None:
    """None: as it is."""
    if wire is None or not dtype.is_floating_point:
        return None
    if wire in _CAST_DTYPES:
        return _Cast(_CAST_DTYPES[wire]) if dtype.itemsize > 2 else None
    return _Quantized(int(wire[3:]), spec.block_size, spec.scheme)


class _Pending:
    def __init__(self, work: dist.Work | None, land: Callable[[], None]) -> None:
        self.work, self.land = work, land

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.land()
        return True


class CompressedComm:
    def __init__(self, spec: CompressionSpec) -> None:
        self.spec = spec
        self.feedback = ErrorFeedback(Codec()) if spec.error_feedback else None

    # ------------------------------------------------------------------ gradients
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        key: object,
        async_op: bool = True,
        unit: int = 0,
    ) -> dist.Work | _Pending | None:
        """Like ``collectives.reduce_scatter``; not compressed under ``inter_node_only``, a shard group being a
        node's."""
        transport = self._gradient_transport(input.dtype, replicas=False)
        world = collectives.world_size(group)
        if transport is None or world == 1:
            return collectives.reduce_scatter(output, input, group=group, async_op=async_op, unit=unit)
        me = collectives.rank(group)
        chunks = input.view(world, -1)
        numel = chunks.shape[1]
        send = transport.buffer(world, numel, input.device)
        for j in range(world):
            if j != me:  # the own chunk never travels: see [Note: whose values are decoded]
                transport.encode(chunks[j], send[j], self.feedback, ("rs", key, (j - me) % world))
        recv = torch.empty_like(send)
        work = collectives.all_to_all(recv, send, group=group, async_op=True, unit=unit)

        def land() -> None:
            total = chunks[me].to(torch.float32, copy=True)
            part = torch.empty(numel, dtype=torch.float32, device=input.device)
            for i in range(world):
                if i != me:
                    total.add_(transport.decode(recv[i], numel, part))
            output.copy_(total)

        pending = _Pending(work, land)
        if async_op:
            return pending
        pending.wait()
        return None

    def sum_over(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, key: object) -> None:
        """See [Note: whose values are decoded]."""
        transport = self._gradient_transport(tensor.dtype, replicas=True)
        if transport is None:
            collectives.all_reduce(tensor, group=group)
            return
        flat = tensor.view(-1)
        send = transport.buffer(1, flat.numel(), flat.device)
        transport.encode(flat, send[0], self.feedback, ("replicas", key))
        gathered = transport.buffer(collectives.world_size(group), flat.numel(), flat.device)
        collectives.all_gather(gathered.view(-1), send.view(-1), group=group)
        total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        part = torch.empty_like(total)
        for row in gathered:
            total.add_(transport.decode(row, flat.numel(), part))
        flat.copy_(total)

    def _gradient_transport(self, dtype: torch.dtype, replicas: bool) -> _Cast | _Quantized | None:
        if self.spec.inter_node_only and not replicas:
            return None
        return _transport(self.spec.gradients, self.spec, dtype)

    # ------------------------------------------------------------------ parameters
    def compresses_params(self, dtype: torch.dtype) -> bool:
        return _transport(self.spec.params, self.spec, dtype) is not None

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup | None,
        async_op: bool = True,
        unit: int = 0,
    ) -> dist.Work | _Pending | None:
        """See [Note: whose values are decoded]."""
        transport = _transport(self.spec.params, self.spec, input.dtype)
        world = collectives.world_size(group)
        if transport is None or world == 1:
            return collectives.all_gather(output, input, group=group, async_op=async_op, unit=unit)
        numel = input.numel()
        send = transport.buffer(1, numel, input.device)
        transport.encode(input.reshape(-1), send[0], None, None)  # weights: re-encoded from exact masters each step
        recv = transport.buffer(world, numel, input.device)
        work = collectives.all_gather(recv.view(-1), send.view(-1), group=group, async_op=True, unit=unit)
        rows = output.view(world, numel)

        def land() -> None:
            part = torch.empty(numel, dtype=torch.float32, device=output.device)
            for i in range(world):
                rows[i].copy_(transport.decode(recv[i], numel, part))

        pending = _Pending(work, land)
        if async_op:
            return pending
        pending.wait()
        return None

    # ------------------------------------------------------------------ state
    def residuals(self) -> dict[str, torch.Tensor]:
        return self.feedback.state_dict() if self.feedback is not None else {}

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        if self.feedback is not None:
            self.feedback.load_state_dict(residuals)
