"""TRL trainers under hf_longctx SP: which ones run exactly, and the SP paths of those that need one.

`support.check_trainer` runs while a Trainer is being constructed (from the `_validate_args` patch in
`integrations/trainer/patches.py`): a TRL trainer without an exact SP path is refused there, by name,
and a supported one sets up its SP path (`Support.setup`): `reward.py` (RewardTrainer's last-token
score), `dpo.py` (DPOTrainer's per-row log-prob sums over the SP group), `kto.py` (KTOTrainer's, and its KL
pairs'; both on `row_logps.py`), `grpo.py` and `rloo.py` (GRPOTrainer's and RLOOTrainer's sharded log-prob forward
and loss, both installed by `online.py`).
"""
