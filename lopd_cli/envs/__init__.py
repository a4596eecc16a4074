"""Built-in environments (worlds the agent acts in)."""
