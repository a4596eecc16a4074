"""Generation backends: turn a batch of prompt token ids into sampled continuations."""
