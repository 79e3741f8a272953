"""``kaisoku probe``: the command line over :func:`kaisoku.plan.probe.probe` (this node) and
:func:`kaisoku.plan.probe_hosts.probe_job` (every host of a torchrun or srun job)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kaisoku.command_parser import CommandParser
from kaisoku.distributed.env import inside_slurm_step, inside_torchrun
from kaisoku.errors import ConfigError
from kaisoku.fsutil import atomic_write_text
from kaisoku.plan.probe import measure_step, probe
from kaisoku.plan.probe_hosts import probe_job

if TYPE_CHECKING:
    from kaisoku.config import Config


def cmd_probe(argv: Sequence[str], *, train_config: Callable[[str], Config]) -> int:
    """``kaisoku probe PATH [--out machine.toml] [--seconds S] [--local DIR] [--train CONFIG [--ranks N]]``.

    ``train_config(path)`` turns the ``--train`` file into the Config ``kaisoku train`` would run with.
    """
    import tomli_w
    from rich.progress import Progress

    parser = CommandParser(
        prog="kaisoku probe",
        description=(
            "Measure the file system holding PATH (sequential and small-file reads vs readers) and this "
            "node's local disk and RAM tiers; write a cluster TOML profile for kaisoku plan. Under "
            "torchrun or srun (one task per host), every host measures its own view of PATH, all reading "
            "at once, and the links between every pair of hosts; host 0 writes one profile of them all."
        ),
    )
    parser.add_argument("path", help="a folder on the file system to measure (scratch files go under it)")
    parser.add_argument("--out", default="machine.toml", help="profile to write (default machine.toml)")
    parser.add_argument("--seconds", type=float, default=60.0, help="time budget (default 60)")
    parser.add_argument(
        "--local-dir", "--local", dest="local", default="",
        help="node-local folder to measure (default: the temp folder; under torchrun write --local-dir)",
    )  # fmt: skip
    parser.add_argument(
        "--train", default="", metavar="CONFIG",
        help="also time one training step of this kaisoku train config (TOML) into [compute]",
    )  # fmt: skip
    parser.add_argument(
        "--ranks",
        type=int,
        default=0,
        help="ranks the config's global batch is split over (default: its dist.nproc)",
    )
    args = parser.parse_args(list(argv))
    if args.seconds <= 0:
        raise ConfigError(f"--seconds must be > 0 (got {args.seconds})")
    # A bad --train config stops here, before the file system is measured.
    train_cfg = train_config(args.train) if args.train else None
    with Progress(transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("probe", total=1.0)

        def report(what: str, fraction: float) -> None:
            bar.update(task, completed=fraction, description=what)

        if inside_torchrun() or inside_slurm_step():
            measured = probe_job(args.path, seconds=args.seconds, local=args.local or None, progress=report)
            if measured is None:  # another host's rank: host 0 writes the profile
                return 0
            profile = measured
        else:
            profile = probe(args.path, seconds=args.seconds, local=args.local or None, progress=report)
    if train_cfg is not None:
        seconds = min(30.0, max(1.0, args.seconds / 4))
        step = measure_step(train_cfg, config=args.train, seconds=seconds, ranks=args.ranks)
        profile["compute"] = {"step_seconds": step["step_seconds"], "batch_per_rank": step["batch_per_rank"]}
        # The step was timed at the per-rank batch of this many ranks: the plan prices that many per node.
        profile["cluster"]["ranks_per_node"] = step["ranks"]
        profile["probe"]["compute_method"] = f"{step['method']}; config {step['config']}"
    hosts = len(profile.get("host", ()))
    header = (
        f"# kaisoku probe profile: measured on {hosts} hosts together (see [probe] for how)\n"
        if hosts
        else "# kaisoku probe profile: measured on this node (see [probe] for how); "
        "nodes, ranks and network are to be set for the real cluster\n"
    )
    atomic_write_text(Path(args.out), header + tomli_w.dumps(profile))
    fs = profile["shared_fs"]
    compute = profile.get("compute")
    if compute:
        print(
            f"compute: {compute['step_seconds']:.4g} s per step at batch {compute['batch_per_rank']} per rank"
        )
    print(
        f"wrote {args.out}: sequential {fs['seq_read_MBps'][0]}..{max(fs['seq_read_MBps'])} MB/s, "
        f"small files {fs['small_reads_per_s'][0]}..{max(fs['small_reads_per_s'])}/s "
        f"({profile['probe']['seconds']} s)"
    )
    if hosts > 1:
        net = profile["network"]
        print(
            f"{hosts} hosts; links {net['node_bandwidth_MBps_low']}..{net['node_bandwidth_MBps_high']} MB/s "
            f"(median {net['node_bandwidth_MBps']})"
        )
    return 0
