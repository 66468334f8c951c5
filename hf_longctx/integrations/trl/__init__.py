"""TRL trainer integrations (GRPO: grpo.py)."""
