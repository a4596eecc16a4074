"""Pipelines: drivers that chain the stages (bank → retrieve → compose → teach → distill → export)."""
