"""Fault injection for tests, installed through hooks so the training loop holds none."""
