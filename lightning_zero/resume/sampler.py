"""A training DataLoader that continues an interrupted epoch where it stopped.

After a restore, the strategy re-creates the user's train DataLoader (Lightning's ``_update_dataloader``, the
same path that puts a ``DistributedSampler`` in) around a :class:`ResumeSampler`, which

* drops the indices of the batches already trained on, once, in the resumed epoch only: no skipped sample is
  loaded, and ``len()`` stays the full epoch's (Lightning counts the resumed epoch's batches from where it
  stopped, so it needs the full length to know when the epoch ends); later epochs pass through unchanged;
* sets the resumed epoch on the sampler before any iterator exists: Lightning itself only calls ``set_epoch``
  after creating the first iterator, which with ``num_workers > 0`` (workers draw indices at once) replays
  epoch 0's order after a restart (measured, lightning 2.6);
* tells the strategy when each iterator starts drawing indices, which is where the RNG state is put back
  (``resume/state.py``).

The order is exact when the sampler's order is fixed by its construction and ``set_epoch`` --
``DistributedSampler`` (which Lightning puts into every ZeroStrategy run unless ``use_distributed_sampler=False``),
a sequential sampler, or a seeded generator the user re-creates.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls, has_iterable_dataset, sized_len
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _update_dataloader
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from lightning_zero.resume.position import DataPosition


class ResumeSampler(Sampler[Any]):
    """``source`` without its first ``skip`` items in ``epoch`` (once); unchanged in every other epoch.

    ``on_iterator(self)`` is called when an iterator of the DataLoader starts drawing indices: at its first
    fetch (``num_workers=0``) or when its workers are primed, in either case after the DataLoader drew the
    iterator's base seed and before any sample is loaded in this process (see ``resume/state.py``).
    """

    def __init__(
        self,
        source: Iterable[Any],
        skip: int,
        epoch: int,
        on_iterator: Callable[[ResumeSampler], None] | None = None,
        uses_global_rng: bool = True,
        loads_in_process: bool = True,
    ) -> None:
        self.source = source
        self.skip = skip
        self.resume_epoch = epoch
        self.epoch = epoch
        self.on_iterator = on_iterator
        self.uses_global_rng = uses_global_rng  # the DataLoader draws its iterators' base seed from the global RNG
        self.loads_in_process = loads_in_process  # num_workers=0: samples are loaded (augmented) in this process
        self._pending = skip > 0
        self.set_epoch(epoch)

    @property
    def sampler(self) -> Iterable[Any]:
        """The sampler Lightning sets the epoch on (``dataloader.sampler`` / ``batch_sampler.sampler``)."""
        return self.source

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for target in _epoch_targets(self.source):
            target.set_epoch(epoch)

    def __len__(self) -> int:
        if not isinstance(self.source, Sized):
            raise TypeError(f"object of type {type(self.source).__name__!r} has no len()")
        return len(self.source)

    def __iter__(self) -> Iterator[Any]:
        # A generator: the body runs at the first index drawn, not when the DataLoader iterator is created.
        if self.on_iterator is not None:
            self.on_iterator(self)
        items = iter(self.source)
        if self._pending and self.epoch == self.resume_epoch:
            self._pending = False
            items = itertools.islice(items, self.skip, None)
        yield from items


class ResumeBatchSampler(ResumeSampler):
    """The same for a custom batch sampler: skips whole batches (lists of indices), whatever their grouping."""

    @property
    def sampler(self) -> Iterable[Any]:
        return getattr(self.source, "sampler", self.source)


def _epoch_targets(source: object) -> list[Any]:
    """``source`` and the sampler under it (a batch sampler's), each once, where they have ``set_epoch``."""
    found: dict[int, object] = {}
    for obj in (source, getattr(source, "sampler", None)):
        if obj is not None and callable(getattr(obj, "set_epoch", None)):
            found[id(obj)] = obj
    return list(found.values())


def resume_dataloader(
    dataloader: object, position: DataPosition, on_iterator: Callable[[ResumeSampler], None] | None = None
) -> object:
    """``dataloader`` for a fit resuming at ``position``: a new instance that starts the resumed epoch after its
    ``position.batches_done`` batches (see the module docstring) and calls ``on_iterator`` as each of its
    iterators starts (:class:`ResumeSampler`), or the same object where nothing can be done (then a warning says
    what the resumed epoch will see)."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader, _Stateful):
        return dataloader  # Lightning restores a loader with state_dict/load_state_dict itself (combined_loader)
    if has_iterable_dataset(dataloader):
        if position.mid_epoch and not isinstance(dataloader.dataset, _Stateful):
            rank_zero_warn(
                "ZeroStrategy resumed mid-epoch, but the train DataLoader iterates an IterableDataset, which has no "
                f"indices to skip: epoch {position.epoch} starts again from its first batch. Give the dataset "
                "`state_dict()`/`load_state_dict()` (Lightning then saves and restores its position) or resume from "
                "an end-of-epoch checkpoint."
            )
        return dataloader
    length = sized_len(dataloader)
    skip = position.batches_done % length if length else 0  # a shorter loader cycled by CombinedLoader
    _warn_if_order_not_reproducible(dataloader, position, skip)
    batch_sampler = dataloader.batch_sampler
    rng = dict(uses_global_rng=dataloader.generator is None, loads_in_process=dataloader.num_workers == 0)
    if batch_sampler is None or type(batch_sampler) is BatchSampler:
        size = 1 if batch_sampler is None else batch_sampler.batch_size
        sampler = ResumeSampler(dataloader.sampler, skip * size, position.epoch, on_iterator, **rng)
        return _update_dataloader(dataloader, sampler)
    return _with_batch_sampler(dataloader, ResumeBatchSampler(batch_sampler, skip, position.epoch, on_iterator, **rng))


def _with_batch_sampler(dataloader: DataLoader[Any], batch_sampler: ResumeBatchSampler) -> object:
    """Re-create ``dataloader`` around a wrapped custom batch sampler (as Lightning re-creates it around a
    sampler); a loader class that cannot take one is left as it is, with a warning."""
    try:
        args, kwargs = _get_dataloader_init_args_and_kwargs(dataloader, dataloader.sampler)
        kwargs.update(batch_sampler=batch_sampler, sampler=None, batch_size=1, shuffle=False, drop_last=False)
        return _reinstantiate_wrapped_cls(dataloader, *args, **kwargs)
    except Exception as err:  # noqa: BLE001 - a user class we cannot re-create: say so and go on as Lightning does
        rank_zero_warn(
            f"ZeroStrategy resumed mid-epoch but could not re-create the train {type(dataloader).__name__} around its "
            f"batch sampler ({err}); epoch {batch_sampler.resume_epoch} starts again from its first batch. Accept "
            "`batch_sampler=` in the loader's __init__ (or **kwargs) to resume exactly."
        )
        return dataloader


def _warn_if_order_not_reproducible(dataloader: DataLoader[Any], position: DataPosition, skip: int) -> None:
    sampler = dataloader.sampler
    if skip and isinstance(sampler, RandomSampler) and sampler.generator is None:
        rank_zero_warn(
            "ZeroStrategy resumed mid-epoch with a RandomSampler that draws a new order from the global RNG each "
            f"epoch: the {skip} batches skipped in epoch {position.epoch} are not the ones trained on before the "
            "restart. Keep `use_distributed_sampler=True` (Lightning's DistributedSampler, seeded per epoch) or give "
            "the sampler a generator you seed."
        )
