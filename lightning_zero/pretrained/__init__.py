"""Pretrained weights into a sharded model, each rank reading only its rows (``loading.py``), through a Hugging Face
model's conversion mapping where the files' layout differs from the model's (``conversion.py``)."""

from lightning_zero.pretrained.loading import WeightsFile, detect_prefix, load_pretrained, match_keys

__all__ = ["WeightsFile", "detect_prefix", "load_pretrained", "match_keys"]
