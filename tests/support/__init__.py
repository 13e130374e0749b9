"""Helpers for tests (and benchmarks) only: a tiny random model and an in-process plan driver.

Production packages (conveyor/, services/, shared/, kernels/) never import this package;
tests/unit/test_no_test_code_in_production.py checks it. It is not installed with the project.
"""
