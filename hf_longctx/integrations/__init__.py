"""How hf_longctx hooks into other libraries: `trainer/` (transformers Trainer, TRL, accelerate).

They patch through `hf_longctx/_patching.py`, the only monkeypatching mechanism (reversible, idempotent).
"""
