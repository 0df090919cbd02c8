"""Glue to other training libraries: `trl` (a rollout_func for TRL's GRPOTrainer)."""
