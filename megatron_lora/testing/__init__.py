"""Helpers for correctness checks across parallel layouts (used by tests and the demo)."""
