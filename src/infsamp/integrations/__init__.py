"""Glue to other training libraries: `infsamp.integrations.trl` (a rollout_func for TRL's GRPOTrainer)."""
