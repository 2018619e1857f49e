"""RL-VLA3: asynchronous RL fine-tuning of VLA policies (core: no Ray; workers and runner: Ray)."""
