"""The resume of one ``fit``, from the launcher's choice to the first resumed batch, as ZeroStrategy's hooks
see it.

[Note: when the RNG state is restored]
A checkpoint holds every rank's RNG state at the save (P). A resumed run draws the same dropout masks (and
main-process augmentations) as an uninterrupted one only if, when its first batch is fetched, the global RNG is
where the uninterrupted run's was. Between P and that point both runs draw, and not the same things:

* creating a DataLoader iterator draws its base seed from the global RNG. After a mid-epoch checkpoint the
  uninterrupted run's train iterator existed at P; after an end-of-epoch checkpoint it created the next
  epoch's after P. After a save in ``on_train_batch_end`` of a batch followed by validation it also created
  one iterator per validation DataLoader (a validation Lightning's restart then skips);
* the resumed run creates a train iterator in ``FitLoop.setup_data`` and, depending on Lightning's restart state
  machine, sometimes another for the next epoch (measured: after a checkpoint saved in ``on_validation_end`` at
  an epoch's end, not after a SIGTERM checkpoint at the same batch); its restart logic may also create a
  validation iterator it never runs (``increment_progress_to_evaluation_end``).

So the state is put back as late as possible, after all of the resumed run's own draws: where a train iterator
starts drawing indices, which with ``num_workers=0`` is its first fetch (:class:`.sampler.ResumeSampler` reports
it, after the iterator's base-seed draw and before any sample is loaded), and again for every new iterator
until the first resumed batch begins; with workers, which load samples in their own processes, right before the
first resumed ``training_step``. Then the uninterrupted run's iterator creations after P are replayed -- a
throwaway iterator of a one-sample DataLoader draws exactly what any DataLoader iterator draws: the next epoch's
train iterator (known from the position) and the validation iterators, counted when the checkpoint was written
(:func:`draws_after_save`). Not replayed: draws *inside* such a validation, and draws of user hooks between P and
the next batch (e.g. ``on_train_epoch_start``). The user's ``setup`` and ``train_dataloader()`` run before the
restore and draw what they drew in the uninterrupted run's first start (e.g. a ``random_split``). ``validate`` /
``test`` / ``predict`` with a ``ckpt_path`` restore the state at once, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loops.progress import _ProcessedTracker
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from lightning_zero.resume.agreement import JOB_KEY, check_agreement, job_identity
from lightning_zero.resume.ckpt_path import ResumeDecision
from lightning_zero.resume.position import DataPosition, position_from_loops
from lightning_zero.resume.rng import restore_rng_state
from lightning_zero.resume.sampler import ResumeSampler, resume_dataloader
from lightning_zero.resume.sigterm import save_on_sigterm

#: Checkpoint key of :func:`draws_after_save`.
DRAWS_KEY = "lightning_zero_draws_after_save"


class ResumeState:
    """Held by the strategy; each of its hooks hands over what it needs."""

    def __init__(self) -> None:
        self.decision: ResumeDecision | None = None
        self.position: DataPosition | None = None
        self._rng: dict[str, Any] | None = None
        self._source: ResumeSampler | None = None  # the train loader whose iterators put the RNG state back
        self._wrapped = False
        self._pending_iterators = 0

    def check_agreement(self) -> None:
        """Collective where the launcher made an auto-resume decision (then every rank did): see
        :func:`~lightning_zero.resume.agreement.check_agreement`."""
        if self.decision is not None:
            decision, self.decision = self.decision, None
            check_agreement(decision.path)

    def loaded(
        self, checkpoint: Mapping[str, Any], trainer: pl.Trainer | None, rng_state: dict[str, Any] | None
    ) -> None:
        """A checkpoint was read: keep this rank's RNG state and the data position for the hooks below."""
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            if rng_state is not None:
                restore_rng_state(rng_state)
            return
        self._rng, self._source, self._wrapped = rng_state, None, False
        self.position = position_from_loops(checkpoint.get("loops"))
        after = checkpoint.get(DRAWS_KEY)
        self._pending_iterators = int(after.get("iterators", 0)) if isinstance(after, Mapping) else 0

    def process_dataloader(self, dataloader: object, trainer: pl.Trainer | None) -> object:
        """The train DataLoader of a resumed fit continues its epoch where the checkpoint left it."""
        if self.position is None or trainer is None or not trainer.training:
            return dataloader
        resumed = resume_dataloader(dataloader, self.position, self._iterator_started)
        self._wrapped |= resumed is not dataloader
        if resumed is dataloader and not self.position.mid_epoch:
            self._restore_rng()  # a loader we cannot follow: before its first iterator exists, at least
        return resumed

    def on_train_start(self, trainer: pl.Trainer | None) -> None:
        """After the callbacks' ``on_train_start``: a mid-epoch resume takes up the epoch's accumulation schedule."""
        if trainer is not None and self.position is not None and self.position.mid_epoch:
            _follow_accumulation_schedule(self.position, trainer)
            _report_mid_epoch(self.position, trainer)
        if not self._wrapped:
            self._restore_rng()

    def on_train_batch_start(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """The first resumed batch ends the resume; it must be the batch skipped to: a mismatch means Lightning's
        restart logic changed (see :mod:`.position`), and the data would not be the uninterrupted run's."""
        if self._source is not None and not self._source.loads_in_process:
            self._put_back_rng(self._source)
        position, self.position, self._rng, self._source = self.position, None, None, None
        resumed_at = (trainer.current_epoch, batch_idx)
        if position is not None and not position.after_fit and resumed_at != (position.epoch, position.batches_done):
            rank_zero_warn(
                f"ZeroStrategy skipped the train data to epoch {position.epoch}, batch {position.batches_done}, but "
                f"Lightning resumed at epoch {trainer.current_epoch}, batch {batch_idx}: the data after this resume "
                "differs from an uninterrupted run's. Please report this with your Lightning version."
            )

    def on_save(self, checkpoint: dict[str, Any], trainer: pl.Trainer | None) -> None:
        """What a resume from this checkpoint must replay (:func:`draws_after_save`), and which launcher job wrote
        it (:func:`~lightning_zero.resume.agreement.job_identity`)."""
        checkpoint[DRAWS_KEY] = draws_after_save(trainer)
        checkpoint[JOB_KEY] = job_identity()

    def on_exception(self, trainer: pl.Trainer | None, exception: BaseException) -> None:
        if trainer is not None:
            save_on_sigterm(trainer, exception)

    def _iterator_started(self, source: ResumeSampler) -> None:
        """A train iterator starts drawing indices (see [Note: when the RNG state is restored]). With several
        train loaders, the first one's iterators decide."""
        if self._rng is None or self.position is None or self._source not in (None, source):
            return
        self._source = source
        if source.loads_in_process:
            self._put_back_rng(source)

    def _put_back_rng(self, source: ResumeSampler) -> None:
        if self._rng is None or self.position is None:
            raise RuntimeError("lightning_zero internal error: a source is only taken while both are held")
        restore_rng_state(self._rng)
        replays = self._pending_iterators + (not self.position.mid_epoch and source.uses_global_rng)
        for _ in range(replays):
            # The base-seed draw of an iterator the uninterrupted run created after the save.
            iter(DataLoader([0]))  # type: ignore[arg-type]  # torch annotates ``dataset`` as Dataset; a list serves

    def _restore_rng(self) -> None:
        if self._rng is not None:
            restore_rng_state(self._rng)
            self._rng = None


def draws_after_save(trainer: pl.Trainer | None) -> dict[str, int]:
    """Recorded in every checkpoint (under :data:`DRAWS_KEY`): how many DataLoader iterators drawing from the global
    RNG the run creates after this save and before its next training batch -- one per validation DataLoader when
    the save happens in ``on_train_batch_end`` of a batch after which validation is due (Lightning's own
    ``_should_check_val_fx`` decides, as it will right after)."""
    if trainer is None:
        return {"iterators": 0}
    try:
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.batch_progress.current
        in_batch_end = (
            trainer.training and isinstance(current, _ProcessedTracker) and current.completed == current.processed - 1
        )
        fetcher = trainer.fit_loop._data_fetcher
        if not in_batch_end or fetcher is None or not epoch_loop._should_check_val_fx(fetcher):
            return {"iterators": 0}
        loaders = trainer.val_dataloaders
        loaders = (
            loaders
            if isinstance(loaders, (list, tuple))
            else list(loaders.values())
            if isinstance(loaders, dict)
            else [loaders]
        )
        return {"iterators": sum(isinstance(dl, DataLoader) and dl.generator is None for dl in loaders)}
    except Exception:  # noqa: BLE001 - outside a fit loop (e.g. a manual save): nothing is pending
        return {"iterators": 0}


def _follow_accumulation_schedule(position: DataPosition, trainer: pl.Trainer) -> None:
    """Lightning runs no ``on_train_epoch_start`` for an epoch it resumes mid-way (the interrupted run did), so the
    accumulation a ``GradientAccumulationScheduler`` set there, which lives on the trainer and not in the
    checkpoint, would fall back to the Trainer's own for the rest of the epoch (``ddp`` too): set it as that hook
    did. (Its ``on_train_start`` has run by now: it refuses a Trainer whose setting is not 1.)"""
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # Lightning types it loosely
        if isinstance(callback, GradientAccumulationScheduler):
            trainer.accumulate_grad_batches = callback.get_accumulate_grad_batches(position.epoch)


def _report_mid_epoch(position: DataPosition, trainer: pl.Trainer) -> None:
    """Accumulated gradients are not part of a checkpoint: a save inside an accumulation window loses the
    micro-batches before it. ModelCheckpoint and the SIGTERM checkpoint only save at window boundaries."""
    accumulate = trainer.accumulate_grad_batches
    module = trainer.lightning_module
    automatic = module is None or module.automatic_optimization
    if automatic and accumulate > 1 and position.batches_done % accumulate:
        rank_zero_warn(
            f"The checkpoint was taken inside an accumulation window (batch {position.batches_done} of epoch "
            f"{position.epoch}, accumulate_grad_batches={accumulate}): the gradients of its first "
            f"{position.batches_done % accumulate} micro-batch(es) were not saved, so the first optimizer step after "
            "resuming uses only the rest of the window."
        )
    rank_zero_info(
        f"Resuming mid-epoch: epoch {position.epoch} continues after its first {position.batches_done} batches."
    )
