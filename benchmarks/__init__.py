"""Benchmarks of paramupdates (not tests): ratios measured side by side in one process.

Run ``python -m benchmarks`` (or ``python benchmarks/run.py``) from the repository root.
"""
