"""Supervised training: `kilovla train` (trainer.py), torchrun/DDP/FSDP2 (distributed.py),
checkpoints (checkpoint.py), metrics (metrics.py)."""
