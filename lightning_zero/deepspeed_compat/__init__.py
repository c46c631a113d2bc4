"""DeepSpeed JSON configs: parsed and checked (``config.py``), then applied to a run (``trainer.py``)."""
