"""Cluster and dataset descriptions for ``kaisoku plan``: TOML files checked key by key.

A bad value stops with one line naming the file and the key (:class:`~kaisoku.errors.ConfigError`).
Rates are decimal MB/s (1 MB = 10^6 bytes); sizes take kaisoku's byte strings ("1.6TB", "64MiB") or
plain byte counts. The layout (every key of ``examples/clusters/*.toml``)::

    [cluster]    name, nodes, ranks_per_node, readers_per_node
    [shared_fs]  readers = [1, 2, 4, ...], seq_read_MBps = [...], small_reads_per_s = [...],
                 small_file_bytes; optional seq_read_MBps_low/_high and small_reads_per_s_low/_high
                 (the slowest and fastest of the passes behind each figure, as kaisoku probe writes them)
    [network]    node_bandwidth_MBps; optional node_bandwidth_MBps_low/_high; optional links_MBps, an N x N
                 matrix (host i to host j, the diagonal unused) with links_MBps_low/_high, N the hosts
    [[host]]     optional, one per probed host, in the job's order: name, seq_read_MBps and
                 small_reads_per_s (its rate at each shared_fs.readers point, all hosts reading),
                 local_read_MBps, local_write_MBps, ram_bandwidth_MBps
    [local]      path, capacity, read_MBps, write_MBps
    [ram]        capacity, bandwidth_MBps
    [compute]    step_seconds, batch_per_rank, loader_samples_per_s (a node's loader from RAM; 0: no limit)

    [dataset]    name, samples, sample_bytes, sample_bytes_std, samples_per_file, shard_bytes
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from kaisoku.data.shards.format import read_index, split_dirs
from kaisoku.errors import ConfigError
from kaisoku.plan.model import MB, Cluster, Dataset, RateTable
from kaisoku.units import parse_bytes

_SECTIONS = {
    "cluster": {"name", "nodes", "ranks_per_node", "readers_per_node"},
    "shared_fs": {
        "readers",
        "seq_read_MBps",
        "small_reads_per_s",
        "small_file_bytes",
        *(f"{key}_{end}" for key in ("seq_read_MBps", "small_reads_per_s") for end in ("low", "high")),
    },
    "network": {
        "node_bandwidth_MBps",
        *(f"{key}_{end}" for key in ("node_bandwidth_MBps", "links_MBps") for end in ("low", "high")),
        "links_MBps",
    },
    "host": None,  # an array of tables, checked by _hosts
    "local": {"path", "capacity", "read_MBps", "write_MBps"},
    "ram": {"capacity", "bandwidth_MBps"},
    "compute": {"step_seconds", "batch_per_rank", "loader_samples_per_s"},
    "probe": None,  # free-form: how the numbers were measured
    "dataset": None,  # a cluster file may carry a dataset too
}
_HOST_KEYS = {
    "name", "seq_read_MBps", "small_reads_per_s", "local_read_MBps", "local_write_MBps", "ram_bandwidth_MBps",
}  # fmt: skip
_DATASET_KEYS = {"name", "samples", "sample_bytes", "sample_bytes_std", "samples_per_file", "shard_bytes"}


def _load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such file")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{p}: not valid TOML ({error})") from None


def _is_rate(value: object) -> bool:
    """Whether a table entry is a rate: a number (not a bool) > 0."""
    return not isinstance(value, bool) and isinstance(value, int | float) and value > 0


class _Reader:
    """Typed, checked access to one TOML mapping; every error names ``<file>: <section>.<key>``."""

    def __init__(self, where: str, data: dict[str, Any]) -> None:
        self.where = where
        self.data = data

    def _fail(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {key} {message}")

    def raw(self, key: str, default: Any = None) -> Any:
        section, _, name = key.partition(".")
        block = self.data.get(section, {})
        if not isinstance(block, dict):
            raise self._fail(section, "must be a table")
        if name not in block:
            if default is None:
                raise self._fail(key, "is missing")
            return default
        return block[name]

    def number(self, key: str, default: float | None = None, *, positive: bool = True) -> float:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._fail(key, f"must be a number (got {value!r})")
        if positive and value <= 0:
            raise self._fail(key, f"must be > 0 (got {value})")
        if value < 0:
            raise self._fail(key, f"must be >= 0 (got {value})")
        return float(value)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, f"must be a whole number (got {value!r})")
        if value < 1:
            raise self._fail(key, f"must be >= 1 (got {value})")
        return value

    def size(self, key: str, default: int | str | None = None, *, positive: bool = False) -> float:
        value = self.raw(key, default)
        try:
            nbytes = float(value) if isinstance(value, float) else float(parse_bytes(value))
        except (ConfigError, ValueError, TypeError) as error:
            raise self._fail(key, f"is not a byte size ({error})") from None
        if nbytes < 0 or (positive and nbytes == 0):
            raise self._fail(key, f"must be {'> 0' if positive else '>= 0'} bytes (got {value!r})")
        return nbytes

    def table(self, key: str, readers: tuple[int, ...], scale: float) -> RateTable:
        values = self.raw(key)
        if not isinstance(values, list) or len(values) != len(readers):
            raise self._fail(
                key, f"must be a list of {len(readers)} numbers, one per entry of shared_fs.readers"
            )
        out = []
        for i, value in enumerate(values):
            if not _is_rate(value):
                raise self._fail(f"{key}[{i}]", f"must be a number > 0 (got {value!r})")
            out.append(float(value) * scale)
        return RateTable(readers, tuple(out))


def _paired(r: _Reader, key: str) -> bool:
    """Whether ``key``'s ``_low`` and ``_high`` are given: both or neither (one alone names the other)."""
    given = [k for k in (f"{key}_low", f"{key}_high") if r.raw(k, False) is not False]
    if len(given) == 1:
        raise r._fail(given[0], f"needs its pair ({key}_low and {key}_high come together)")
    return bool(given)


def _bracket(r: _Reader, key: str, low: float, middle: float, high: float, unit: float) -> None:
    """One line naming ``key`` where its figure lies outside its measured range."""
    if not low <= middle <= high:
        name = key.split("[")[0]
        raise r._fail(key, f"must lie within {name}_low and {name}_high ({low / unit:g} .. {high / unit:g})")


def _table_range(
    r: _Reader, key: str, readers: tuple[int, ...], scale: float, middle: RateTable
) -> tuple[RateTable, RateTable] | None:
    """``key``'s optional ``_low`` and ``_high`` tables, each entry bracketing ``middle``'s."""
    if not _paired(r, key):
        return None
    low, high = r.table(f"{key}_low", readers, scale), r.table(f"{key}_high", readers, scale)
    for i, ends in enumerate(zip(low.values, middle.values, high.values, strict=True)):
        _bracket(r, f"{key}[{i}]", *ends, scale)
    return low, high


def _rate_range(r: _Reader, key: str, middle: float) -> tuple[float, float] | None:
    """``key``'s optional ``_low`` and ``_high`` rates (MB/s), bracketing ``middle``."""
    if not _paired(r, key):
        return None
    low, high = r.number(f"{key}_low") * MB, r.number(f"{key}_high") * MB
    _bracket(r, key, low, middle, high, MB)
    return low, high


def _hosts(
    r: _Reader, readers: tuple[int, ...]
) -> tuple[tuple[str, ...], tuple[float, ...], tuple[float, ...]]:
    """The ``[[host]]`` tables: names, and each host's sequential and small-file rate over the hosts' mean
    (the median over the reader counts)."""
    hosts = r.data.get("host", [])
    if not isinstance(hosts, list) or not all(isinstance(h, dict) for h in hosts):
        raise ConfigError(f"{r.where}: host must be an array of tables ([[host]])")
    names, seq, small = [], [], []
    for i, block in enumerate(hosts):
        _check_keys(r.where, {f"host[{i}]": block}, {f"host[{i}]": _HOST_KEYS})
        one = _Reader(r.where, {f"host[{i}]": block})
        names.append(str(one.raw(f"host[{i}].name", f"host {i}")))
        seq.append(one.table(f"host[{i}].seq_read_MBps", readers, MB).values)
        small.append(one.table(f"host[{i}].small_reads_per_s", readers, 1.0).values)

    def shares(tables: list[tuple[float, ...]]) -> tuple[float, ...]:
        means = [sum(column) / len(column) for column in zip(*tables, strict=True)]
        return tuple(sorted(v / m for v, m in zip(t, means, strict=True))[len(means) // 2] for t in tables)

    return tuple(names), (shares(seq) if names else ()), (shares(small) if names else ())


def _links(r: _Reader, key: str, hosts: int) -> tuple[tuple[float, ...], ...]:
    """``network.<key>``: an ``hosts`` x ``hosts`` matrix of link rates (MB/s; the diagonal unused)."""
    rows = r.raw(key)
    if (
        not isinstance(rows, list)
        or len(rows) != hosts
        or any(not isinstance(row, list) or len(row) != hosts for row in rows)
    ):
        raise r._fail(key, f"must be a {hosts} x {hosts} matrix, one row and column per [[host]]")
    out = []
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            if i != j and not _is_rate(value):
                raise r._fail(f"{key}[{i}][{j}]", f"must be a number > 0 (got {value!r})")
        out.append(tuple(float(v) * MB if i != j else 0.0 for j, v in enumerate(row)))
    return tuple(out)


def _link_matrices(
    r: _Reader, hosts: int
) -> tuple[
    tuple[tuple[float, ...], ...], tuple[tuple[tuple[float, ...], ...], tuple[tuple[float, ...], ...]] | None
]:
    """``network.links_MBps`` and its optional range, each entry bracketing the median's."""
    if r.raw("network.links_MBps", False) is False:
        if _paired(r, "network.links_MBps"):
            raise r._fail("network.links_MBps", "is missing (its _low and _high are given)")
        return (), None
    if hosts < 2:
        raise r._fail("network.links_MBps", "needs a [[host]] table per host (two or more)")
    middle = _links(r, "network.links_MBps", hosts)
    if not _paired(r, "network.links_MBps"):
        return middle, None
    low, high = _links(r, "network.links_MBps_low", hosts), _links(r, "network.links_MBps_high", hosts)
    for i in range(hosts):
        for j in range(hosts):
            if i != j:
                _bracket(r, f"network.links_MBps[{i}][{j}]", low[i][j], middle[i][j], high[i][j], MB)
    return middle, (low, high)


def _check_keys(where: str, data: dict[str, Any], sections: dict[str, set[str] | None]) -> None:
    for section, block in data.items():
        if section not in sections:
            raise ConfigError(f"{where}: unknown section [{section}]; expected one of {', '.join(sections)}")
        allowed = sections[section]
        if allowed is not None and isinstance(block, dict):
            for key in block:
                if key not in allowed:
                    raise ConfigError(
                        f"{where}: unknown key {section}.{key}; expected one of {', '.join(sorted(allowed))}"
                    )


def cluster_from_dict(data: dict[str, Any], where: str = "cluster") -> Cluster:
    """A checked :class:`Cluster` from a parsed TOML mapping."""
    _check_keys(where, data, _SECTIONS)
    r = _Reader(where, data)
    nodes = r.integer("cluster.nodes")
    readers_raw = r.raw("shared_fs.readers")
    if not isinstance(readers_raw, list) or not readers_raw:
        raise ConfigError(f"{where}: shared_fs.readers must be a non-empty list of reader counts")
    for i, value in enumerate(readers_raw):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: shared_fs.readers[{i}] must be a whole number >= 1 (got {value!r})")
        if i and value <= readers_raw[i - 1]:
            raise ConfigError(
                f"{where}: shared_fs.readers must increase ({readers_raw[i - 1]} then {value} at [{i}])"
            )
    readers = tuple(readers_raw)
    fs_seq = r.table("shared_fs.seq_read_MBps", readers, MB)
    fs_small = r.table("shared_fs.small_reads_per_s", readers, 1.0)
    network_bw = r.number("network.node_bandwidth_MBps") * MB
    names, seq_share, small_share = _hosts(r, readers)
    links, links_range = _link_matrices(r, len(names))
    return Cluster(
        name=str(r.raw("cluster.name", "cluster")),
        nodes=nodes,
        ranks_per_node=r.integer("cluster.ranks_per_node", 1),
        readers_per_node=r.integer("cluster.readers_per_node", 8),
        fs_seq=fs_seq,
        fs_small=fs_small,
        fs_seq_range=_table_range(r, "shared_fs.seq_read_MBps", readers, MB, fs_seq),
        fs_small_range=_table_range(r, "shared_fs.small_reads_per_s", readers, 1.0, fs_small),
        small_file_bytes=r.size("shared_fs.small_file_bytes", 1500, positive=True),
        network_bw=network_bw,
        network_range=_rate_range(r, "network.node_bandwidth_MBps", network_bw),
        host_names=names,
        host_seq_share=seq_share,
        host_small_share=small_share,
        links=links,
        links_range=links_range,
        local_capacity=r.size("local.capacity", 0),
        local_read_bw=r.number("local.read_MBps", 1000.0) * MB,
        local_write_bw=r.number("local.write_MBps", 1000.0) * MB,
        local_path=str(r.raw("local.path", "")),
        ram_capacity=r.size("ram.capacity", 0),
        ram_bw=r.number("ram.bandwidth_MBps", 5000.0) * MB,
        step_seconds=r.number("compute.step_seconds", 0.0, positive=False),
        batch_per_rank=r.integer("compute.batch_per_rank", 32),
        loader_rate=r.number("compute.loader_samples_per_s", 0.0, positive=False),
    )


def dataset_from_dict(data: dict[str, Any], where: str = "dataset") -> Dataset:
    """A checked :class:`Dataset` from a parsed TOML mapping with a ``[dataset]`` table."""
    block = data.get("dataset")
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: no [dataset] table")
    for key in block:
        if key not in _DATASET_KEYS:
            raise ConfigError(
                f"{where}: unknown key dataset.{key}; expected one of {', '.join(sorted(_DATASET_KEYS))}"
            )
    r = _Reader(where, data)
    return Dataset(
        name=str(r.raw("dataset.name", "dataset")),
        samples=r.integer("dataset.samples"),
        sample_bytes=r.size("dataset.sample_bytes", positive=True),
        sample_bytes_std=r.size("dataset.sample_bytes_std", 0),
        samples_per_file=r.integer("dataset.samples_per_file", 1),
        shard_bytes=r.size("dataset.shard_bytes", 64 * 2**20, positive=True),
    )


def load_cluster(path: str | Path) -> Cluster:
    """The cluster described by the TOML file ``path``."""
    return cluster_from_dict(_load(path), str(path))


def load_dataset(spec: str | Path) -> Dataset:
    """A dataset from a TOML description, a packed dataset folder or its ``index.json``."""
    p = Path(spec)
    if p.suffix == ".toml":
        return dataset_from_dict(_load(p), str(p))
    index_file = p / "index.json" if p.is_dir() else p
    if p.is_dir() and not index_file.is_file():
        # A packed root with one folder per split (as kaisoku train and inspect take it): its training split.
        splits = split_dirs(p)
        chosen = [d for d in splits if d.name == "train"] or splits[:1]
        if chosen:
            index_file = chosen[0] / "index.json"
    if not index_file.is_file():
        raise ConfigError(
            f"--dataset {spec}: neither a .toml description nor a packed dataset (no index.json)"
        )

    index = read_index(index_file.parent)
    sizes = index.shard_nbytes()
    samples = int(index.num_samples)
    mean = float(index.nbytes) / max(samples, 1)
    try:
        meta = json.loads(index_file.read_text()).get("name", index_file.parent.name)
    except (OSError, ValueError):
        meta = index_file.parent.name
    return Dataset(
        name=str(meta),
        samples=samples,
        sample_bytes=mean,
        samples_per_file=1,  # the per-file strategy reads records one by one
        shard_bytes=float(sizes.mean()) if len(sizes) else 64 * 2**20,
    )
