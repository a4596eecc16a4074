"""Drivers that chain the pipeline's stages (bank → retrieve → compose → teach → distill → export)."""
