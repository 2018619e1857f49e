"""Scheduling and learning logic with no Ray import: batcher, staleness gate, streaming step, losses, flow log-probs."""
