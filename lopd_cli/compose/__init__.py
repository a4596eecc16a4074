"""Compose: the learned composer φ (encoder LoRA ψ + resampler χ) that turns retrieved
trajectories into latent tokens, the teacher frame those latents are spliced into, and the cache
of cold-start latents."""
