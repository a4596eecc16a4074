"""Backbones (tiny, SmolLM2, any transformers directory), the latent composer and injection."""
