"""Checkpoints: DCP save and load, integrity checks, safe loading, the Hugging Face export."""
