"""Harnesses that tests and benchmarks share: :mod:`kaisoku.testing.cluster` builds a cluster in a box."""
