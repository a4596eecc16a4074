"""Backbones (tiny, SmolLM2, any transformers directory), adapters, and loading the trained student."""
