"""The agent side: tool-call protocol, environments, and the batched multi-turn rollout runner."""
