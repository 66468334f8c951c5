"""Multimodal models under SP: the vision side on the full row, the decoder on shards (`vision.py`)."""
