"""The I/O planner: which staging and shuffle settings to use on a cluster, and how fast each would be.

- :mod:`kaisoku.plan.model`: the I/O trade-off model, pure functions of a cluster and a dataset;
- :mod:`kaisoku.plan.cluster`: cluster and dataset descriptions (TOML files, packed datasets);
- :mod:`kaisoku.plan.command`: ``kaisoku plan`` (table, recommendation, JSON, plot);
- :mod:`kaisoku.plan.probe`: ``kaisoku probe`` (measures a node and writes a cluster description).
"""
