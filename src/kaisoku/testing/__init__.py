"""Harnesses that tests and benchmarks share: :mod:`kaisoku.testing.cluster` builds a cluster in a box,
:mod:`kaisoku.testing.sshfs` serves a folder from one of its hosts over sshfs."""
