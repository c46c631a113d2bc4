"""Where in the data a resumed run picks up: the epoch its first batch belongs to and how many batches of that
epoch are already done, read from the loop state a checkpoint holds.

Lightning 2.6 restores its loop counters mid-epoch, but a plain ``DataLoader`` starts its epoch again from the
first batch; the strategy then skips the batches already trained on (see :mod:`.sampler`). The numbers here must
be exactly the ones Lightning's loops arrive at when they restart from the same state, so the batch a resumed
run trains on next is the batch Lightning counts it as. They mirror ``_TrainingEpochLoop.reset`` and
``_FitLoop.reset`` (lightning 2.6), measured against real restarts for every place a checkpoint can be taken:

====================================================  =======================================  =================
checkpoint taken in                                    batch progress (current)                 resumes at
====================================================  =======================================  =================
``on_train_batch_end`` of batch k (ModelCheckpoint     ready = started = processed = k+1,       batch k+1
``every_n_train_steps``)                               completed = k
between batches (a SIGTERM checkpoint)                 all four = k                              batch k
``training_step`` of batch k (a user's save)           ready = started = k+1, processed = k     batch k (again)
``on_train_batch_end`` of the epoch's last batch       as the first row, ``is_last_batch``      next epoch, 0
``on_train_epoch_end`` / ``on_validation_end`` at the  epoch progress processed = started       next epoch, 0
end of an epoch
after ``fit`` returned (``max_steps`` or               epoch progress: all four equal;          where Lightning
``max_epochs`` reached; ``trainer.save_checkpoint``)   batch progress: all four equal           numbers it; data
                                                                                                from the first
====================================================  =======================================  =================

The last row is Lightning counting the epoch ``fit`` stopped in as finished. A run continued from such a
checkpoint numbers its next batches from counters its restart logic leaves as they were (measured: the stopped
epoch from the batch count it stopped at, or the next epoch from 0, depending on whether validation ran), while
the data starts at its epoch's first batch. Nothing of that data was trained on, so nothing is skipped: the
resumed run trains on what Lightning ``ddp`` trains on after the same save.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """The first batch a resumed fit trains on."""

    epoch: int
    """The epoch that batch belongs to (the value Lightning passes to ``sampler.set_epoch``)."""

    batches_done: int
    """Batches of that epoch already trained on before the checkpoint; the resumed epoch starts after them."""

    after_fit: bool = False
    """Saved after ``fit`` returned: Lightning numbers the first resumed batch by its own restart logic, not by
    this position (see the table above)."""

    @property
    def mid_epoch(self) -> bool:
        """Whether the checkpoint was taken after the epoch's data iterator had started: its batches must be
        skipped, and its random-number draws at iterator creation had already happened."""
        return self.batches_done > 0


def position_from_loops(loops: Mapping[str, Any] | None) -> DataPosition | None:
    """The :class:`DataPosition` a checkpoint's ``checkpoint["loops"]`` resumes at (None if it holds no fit loop:
    a checkpoint written outside of ``fit``, or by something other than Lightning)."""
    fit = (loops or {}).get("fit_loop")
    if fit is None:
        return None
    try:
        epoch = fit["epoch_progress"]["current"]
        batches = fit["epoch_loop.batch_progress"]
        current = batches["current"]
        ready, started, processed, completed = (int(current[k]) for k in ("ready", "started", "processed", "completed"))
        epoch_ready, epoch_started, epoch_processed, epoch_completed = (
            int(epoch[k]) for k in ("ready", "started", "processed", "completed")
        )
    except (KeyError, TypeError, ValueError):
        return None
    batches_settled = ready == started == processed == completed
    if batches_settled and epoch_ready == epoch_started == epoch_processed == epoch_completed:
        # Saved after ``fit`` returned (the last row of the table above).
        return DataPosition(epoch_processed, 0, after_fit=completed > 0)
    if epoch_processed >= epoch_started:
        # The epoch's batches were all done (saved at its end, or before it began): the next epoch starts fresh.
        return DataPosition(epoch_processed, 0)
    saved_on_batch_end = ready == started == processed == completed + 1
    done = processed if saved_on_batch_end else completed  # Lightning runs a batch it did not complete again
    if batches.get("is_last_batch") and done >= ready:
        return DataPosition(epoch_processed + 1, 0)
    return DataPosition(epoch_processed, done)
