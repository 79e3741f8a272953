"""The I/O planner: which staging and shuffle settings to use on a cluster, and how fast each would be.

- :mod:`kaisoku.plan.model`: the I/O trade-off model, pure functions of a cluster and a dataset;
- :mod:`kaisoku.plan.cluster`: cluster and dataset descriptions (TOML files, packed datasets);
- :mod:`kaisoku.plan.command`: ``kaisoku plan`` (table, recommendation, JSON, plot);
- :mod:`kaisoku.plan.probe`: one node's measurements for ``kaisoku probe``;
- :mod:`kaisoku.plan.probe_hosts`: every host of a torchrun or srun job, merged into one description;
- :mod:`kaisoku.plan.probe_command`: ``kaisoku probe`` (measures and writes a cluster description).
"""
