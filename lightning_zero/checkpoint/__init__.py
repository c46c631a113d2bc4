"""ZeroStrategy checkpoints: what is saved, how it is written, and how it is read back safely.

* ``state_dicts.py``: the full and sharded states, built from the engine's shard records;
* ``write.py`` (atomic, every rank raises when one fails), ``async_save.py`` (the same in the background),
  ``files.py`` (temporary names, durable writes, cleanup of interrupted saves), ``errors.py``;
* ``verify.py`` (manifests, CRC-32s, compatibility with the live model), ``safe_load.py`` (every reader is
  ``weights_only``: no file can execute code), ``io.py`` (loading into the live shards, at any world size
  and stage);
* ``listing.py`` (a directory's checkpoints and their status), ``consolidate.py`` and ``hf_export.py``
  (one file, or a Hugging Face directory, from a sharded checkpoint, streamed).
"""

from lightning_zero.checkpoint.errors import CheckpointSaveError
from lightning_zero.checkpoint.listing import CheckpointEntry, list_checkpoints
from lightning_zero.checkpoint.safe_load import UnsafeCheckpointError
from lightning_zero.checkpoint.verify import CheckpointError

__all__ = ["CheckpointEntry", "CheckpointError", "CheckpointSaveError", "UnsafeCheckpointError", "list_checkpoints"]
