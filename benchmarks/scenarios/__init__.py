"""Reliability scenarios shared by tests/test_reliability_*.py and scripts/torture.py: one module per scenario."""
