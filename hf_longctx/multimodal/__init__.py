"""Multimodal models under SP: the merge on the full row and the decoder on shards (`vision.py`), the vision
tower sharded over the SP group (`vision_shard.py`)."""
