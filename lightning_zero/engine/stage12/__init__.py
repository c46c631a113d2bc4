"""Stages 1-2: our own engine (flat gradient buckets, reduce-scatter, sharded optimizer steps)."""
