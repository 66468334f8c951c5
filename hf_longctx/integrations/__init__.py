"""How hf_longctx hooks into other libraries: `trainer/` (transformers Trainer, TRL, accelerate).

`patching.py` is the only monkeypatching mechanism: reversible, idempotent attribute patches.
"""
