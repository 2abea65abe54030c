"""Turns checkpoints into model and engine directories."""
