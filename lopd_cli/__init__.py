"""lopd: Latent On-Policy Self-Distillation for tool-using and code-writing LLM agents.

The package follows the algorithm's data flow:
bank → retrieve → compose → teach → distill → export.
"""

__version__ = "0.1.0"
