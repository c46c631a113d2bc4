"""Stage 3 over FSDP2 (``fully_shard``), and everything of FSDP2's private API in ``fsdp2_private.py``."""
