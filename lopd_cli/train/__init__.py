"""Training: losses, cold start, LOPD/GRPO/OPSD loops, checkpoints."""
