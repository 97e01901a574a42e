"""Integrations with PyTorch subsystems (distributed, checkpointing, compile)."""
