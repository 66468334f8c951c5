"""Sequence sharding of batches: pure functions in `sharding.py`."""
