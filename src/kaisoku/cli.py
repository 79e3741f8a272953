"""The ``kaisoku`` command: ``kaisoku COMMAND ...`` dispatched to one function per command."""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence

from kaisoku import __version__
from kaisoku.command_parser import CommandParser
from kaisoku.config import (
    Config,
    apply_mapping,
    apply_override,
    iter_fields,
    load_toml,
    to_toml,
    type_name,
    validate,
)
from kaisoku.errors import ConfigError, KaisokuError

# Short flags for the settings people change most; each is also reachable by its dotted key.
_SHORTCUTS = {
    "nproc": "dist.nproc",
    "nnodes": "dist.nnodes",
    "node_rank": "dist.node_rank",
    "rdzv_endpoint": "dist.rdzv_endpoint",
    "max_steps": "train.max_steps",
    "run_dir": "run_dir",
    "resume": "checkpoint.resume",
    "max_restarts": "dist.max_restarts",
    "compile": "train.compile",
}


def _metavar(tp: object) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return "{" + ",".join(str(v) for v in typing.get_args(tp)) + "}"
    return type_name(tp).upper()


def _train_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="kaisoku train",
        usage="kaisoku train [--preset NAME] [--config FILE.toml] [--section.field VALUE ...]",
        description=(
            "Train a model. The config comes from a preset, then a TOML file, then --section.field "
            "overrides. With more than one rank and outside torchrun or srun, kaisoku starts the ranks "
            "itself through torchrun (--standalone)."
        ),
    )
    parser.add_argument("--preset", default="cpu-demo", help="named preset to start from")
    parser.add_argument("--config", help="TOML file applied over the preset")
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as TOML and exit"
    )
    parser.add_argument(
        "--print-plan",
        action="store_true",
        help="print the run plan (layouts, batch sizes, sample shape, task, steps per epoch, ...) and exit",
    )
    parser.add_argument("--nproc", help="ranks to launch on this node (dist.nproc)")
    parser.add_argument(
        "--nnodes",
        help="hosts: N, or MIN:MAX to go on after losing hosts and grow back when they return (dist.nnodes); "
        "same on every host",
    )
    parser.add_argument(
        "--node-rank", help="this host's index with a fixed --nnodes (static rendezvous) (dist.node_rank)"
    )
    parser.add_argument(
        "--rdzv-endpoint", help="HOST[:PORT] where the hosts meet with --nnodes > 1 (dist.rdzv_endpoint)"
    )
    parser.add_argument("--max-steps", help="stop after this many optimizer steps (train.max_steps)")
    parser.add_argument("--run-dir", help="run folder (run_dir)")
    parser.add_argument("--resume", help='"auto" or a checkpoint file (checkpoint.resume)')
    parser.add_argument("--max-restarts", help="torchrun restarts after a failure (dist.max_restarts)")
    parser.add_argument("--compile", help="torch.compile: off, model, optimizer, all or auto (train.compile)")
    group = parser.add_argument_group("config fields (--section.field VALUE)")
    for key, tp, default, doc in iter_fields():
        if key in _SHORTCUTS.values() and "." not in key:
            continue  # a top-level field with a shortcut flag of the same name (--run-dir)
        flags = [f"--{key}"]
        if "_" in key:
            flags.append(f"--{key.replace('_', '-')}")
        group.add_argument(
            *flags,
            dest=f"cfg:{key}",
            metavar=_metavar(tp),
            # argparse formats help with %: a literal one (as in "0.5%") must be doubled.
            help=f"{doc} (default: {default})".replace("%", "%%"),
        )
    return parser


def resolve_config(argv: Sequence[str]) -> tuple[Config, argparse.Namespace]:
    """Parse ``kaisoku train`` arguments into a Config whose sections each checked their own fields."""
    from kaisoku.presets import get_preset  # start-up: presets build configs only for train

    parser = _train_parser()
    args, unknown = parser.parse_known_args(list(argv))
    if unknown:
        first = unknown[0]
        if first.startswith("--"):
            key = first[2:].split("=", 1)[0]
            # Raises with the valid keys of the section it names.
            apply_override(Config(), key, "0")
        raise ConfigError(f"unexpected argument '{first}'; see kaisoku train --help")
    cfg = get_preset(args.preset)
    if args.config:
        apply_mapping(cfg, load_toml(args.config))
    for name, key in _SHORTCUTS.items():
        value = getattr(args, name)
        if value is not None:
            apply_override(cfg, key, value)
    for dest, value in vars(args).items():
        if dest.startswith("cfg:") and value is not None:
            apply_override(cfg, dest[4:], value)
    validate(cfg)
    return cfg, args


def cmd_train(argv: Sequence[str]) -> int:
    """``kaisoku train``."""
    # start-up: each command imports only what it runs
    from kaisoku.distributed.env import inside_slurm_step, inside_torchrun
    from kaisoku.distributed.launch import node_counts

    cfg, args = resolve_config(argv)
    if args.print_config:
        sys.stdout.write(to_toml(cfg))
        return 0
    # start-up: the engine and the planner import torch's model and optimizer stacks, which --help skips
    from kaisoku.engine.build import user_parts
    from kaisoku.engine.run import run_training, train_on_local_ranks, train_rank_then_leave
    from kaisoku.engine.trial import trial_step
    from kaisoku.run_facts import plan_run, planned_world

    # Everything that can be known before launch is refused here, before any rank or run folder exists.
    fewest, most = node_counts(cfg.dist.nnodes)
    parts = user_parts(cfg)  # the user's modules imported and dataset factory called once, here
    plan = plan_run(cfg, planned_world(cfg.dist.nproc, most), parts)
    if not (inside_torchrun() or inside_slurm_step()):
        for nodes in range(fewest, most):  # an elastic run must fit every host count it may shrink to
            plan_run(cfg, planned_world(cfg.dist.nproc, nodes), parts)
    trial_step(plan, parts)  # a user's model, loss and metrics on two samples
    if args.print_plan:
        print(plan.describe())
        return 0
    # This process is the rank: nothing is loaded twice.
    if inside_torchrun() or inside_slurm_step():
        train_rank_then_leave(cfg, parts=parts, plan=plan)
    if plan.world.world_size == 1:
        run_training(cfg, parts=parts, plan=plan)
        return 0
    return train_on_local_ranks(cfg, plan.world.ranks_per_node)


def cmd_datagen(argv: Sequence[str]) -> int:
    """``kaisoku datagen DIR --count N --size S [--kind shapes|cosmo]``."""
    # start-up: each command imports only what it runs
    from kaisoku.data.datagen import CLASSES, generate

    parser = CommandParser(
        prog="kaisoku datagen",
        description=(
            "Write the procedurally drawn shapes dataset as JPEG class folders (--kind shapes), or synthetic "
            "universes for CosmoFlow as DIR/cosmo.npz, int16 [4,D,D,D] volumes and 4 targets (--kind cosmo)."
        ),
    )
    parser.add_argument("dir", help="output folder (must be new or empty)")
    parser.add_argument("--kind", choices=["shapes", "cosmo"], default="shapes", help="which dataset")
    parser.add_argument("--count", type=int, default=8000, help="training samples")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (40), volume side (32)")
    parser.add_argument("--val-count", type=int, default=None, help="validation images (default: count/10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every drawing choice")
    parser.add_argument("--workers", type=int, default=0, help="processes (0: one per core)")
    args = parser.parse_args(list(argv))
    if args.kind == "cosmo":
        # start-up: each command imports only what it runs
        from kaisoku.data.cosmo import generate_cosmo

        path = generate_cosmo(
            args.dir,
            count=args.count,
            size=args.size or 32,
            val_count=args.val_count,
            seed=args.seed,
            workers=args.workers or None,
        )
        print(
            f"wrote {args.count} training universes of {args.size or 32}^3 to {path}; pack it with: kaisoku pack {path} DST"
        )
        return 0
    root = generate(
        args.dir,
        count=args.count,
        size=args.size or 40,
        val_count=args.val_count,
        seed=args.seed,
        workers=args.workers or None,
    )
    print(f"wrote {args.count} training images of {len(CLASSES)} classes to {root}")
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    """``kaisoku bench NAME [--quick] [--out DIR] [--strict] [--allow-dirty] [--mnist PATH]``; ``kaisoku bench
    gpu [--out DIR] [--allow-dirty]`` records every row that needs a GPU."""
    try:  # an optional part: the benchmarks live beside the library, in the repository's benchmarks/
        from kaisoku_bench import main as bench_main
    except ModuleNotFoundError as missing:
        if missing.name != "kaisoku_bench":
            raise
        raise ConfigError(
            "kaisoku bench needs the benchmarks, which are not installed: from a clone of the repository, "
            "pip install -e './benchmarks' (and -e '.[bench]' for the peers they measure against)"
        ) from None
    return bench_main(argv)


def _pack_upgrade(argv: Sequence[str]) -> int:
    """``kaisoku pack --upgrade DIR...``: rewrite each index as the current format version, shards untouched."""
    from pathlib import Path

    # start-up: each command imports only what it runs
    from kaisoku.data.shards.format import FORMAT_VERSION, split_dirs, upgrade_index

    parser = CommandParser(prog="kaisoku pack --upgrade", description=_pack_upgrade.__doc__)
    parser.add_argument("paths", nargs="+", help="packed dataset directories (or directories of splits)")
    for path in parser.parse_args(list(argv)).paths:
        for target in split_dirs(Path(path)) or [Path(path)]:
            index, was = upgrade_index(target)
            done = "already" if was == FORMAT_VERSION else f"upgraded from version {was} to"
            print(f"{index.root}: index {done} version {FORMAT_VERSION} ({index.num_samples:,} samples)")
    return 0


def cmd_pack(argv: Sequence[str]) -> int:
    """``kaisoku pack SRC DST`` (or ``kaisoku pack --upgrade DIR``)."""
    if "--upgrade" in argv:
        return _pack_upgrade([a for a in argv if a != "--upgrade"])
    # start-up: each command imports only what it runs
    from kaisoku.data.shards.codecs import available_codecs
    from kaisoku.data.shards.recode import ImageRecode
    from kaisoku.data.shards.writer import pack
    from kaisoku.units import format_bytes, parse_bytes

    parser = CommandParser(
        prog="kaisoku pack",
        description=(
            "Pack an ImageFolder tree (or SRC/{train,val}/<class>) or a .npz of x_<split>/y_<split> arrays "
            "into checksummed shards with a versioned index.json."
        ),
    )
    parser.add_argument("src", help="ImageFolder directory or .npz file")
    parser.add_argument("dst", help="output directory (new or empty; splits go to DST/<split>/)")
    parser.add_argument("--shard-size", default="64MiB", help="target bytes per shard before compression")
    parser.add_argument(
        "--codec", default="raw", choices=list(available_codecs()), help="codec of non-image fields"
    )
    parser.add_argument(
        "--error-bound",
        type=float,
        default=0.0,
        help="--codec delta only: store every value within this distance of the original (0: lossless)",
    )
    parser.add_argument(
        "--error-mode",
        default="abs",
        choices=["abs", "log1p"],
        help="how --error-bound is measured: abs |decoded - x| <= E; log1p |log1p(decoded) - log1p(x)| <= E "
        "(non-negative integer counts, e.g. volumes a model sees through log1p: small counts stay exact)",
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="packing processes (0: one per core, at most 8)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a previous pack in a non-empty DST")
    parser.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave unreadable images out (listed in the index) instead of failing",
    )
    parser.add_argument(
        "--no-shuffle", action="store_true", help="keep source order instead of a seeded permutation"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of that permutation")
    parser.add_argument(
        "--jpeg-quality",
        type=int,
        default=0,
        help="re-encode every image (but those --raw-side stores raw) as a JPEG of this quality, 1-100 (0: keep "
        "the source's bytes, the default: "
        "a second lossy encoding is yours to choose); FFCV's writer uses 90. Measured (kaisoku bench loader): "
        "--jpeg-quality 90 with 4:2:0 loads 1.38-1.62x more images per second, 64 px to ImageNet-sized photos",
    )
    parser.add_argument(
        "--jpeg-subsampling",
        default="420",
        choices=["444", "422", "420"],
        help="chroma subsampling of re-encoded JPEGs (4:2:0 decodes fastest)",
    )
    parser.add_argument(
        "--max-side",
        type=int,
        default=0,
        help="re-encode images whose longer side exceeds this many pixels at that size (0: keep sizes); "
        "with no --jpeg-quality the quality is 90",
    )
    parser.add_argument(
        "--raw-side",
        type=int,
        default=0,
        help="store images whose longer side is at most this many pixels (after --max-side) as raw pixels "
        "(binary PNM of the decoded pixels, read by a copy with no decoding); other images as the options "
        "above say. Off (0) by default, as they take several times a JPEG's bytes, and shards grow by as much "
        "(--shard-size counts the source files' bytes). Measured on 64 px images (kaisoku bench "
        "loader): 2.5-3.0x the images per second of --jpeg-quality 90 4:2:0, for 5.55x its bytes",
    )
    parser.add_argument(
        "--upgrade",
        action="store_true",
        help="kaisoku pack --upgrade DIR: rewrite DIR's index as the current format version (shards stay)",
    )
    args = parser.parse_args(list(argv))
    if (args.error_bound or args.error_mode != "abs") and args.codec != "delta":
        raise ConfigError(f"kaisoku pack: --error-bound needs --codec delta (got --codec {args.codec})")
    if args.codec == "delta":
        # start-up: each command imports only what it runs
        from kaisoku.data.shards.delta import delta_codec_name

        args.codec = delta_codec_name(args.error_bound, args.error_mode)
    recode = None
    if args.jpeg_quality or args.max_side or args.raw_side:
        try:
            recode = ImageRecode(
                quality=args.jpeg_quality or (90 if args.max_side else 0),
                subsampling=args.jpeg_subsampling,
                max_side=args.max_side,
                raw_side=args.raw_side,
            )
        except ValueError as error:
            raise ConfigError(f"kaisoku pack: {error}") from None
    result = pack(
        args.src,
        args.dst,
        recode=recode,
        shard_bytes=parse_bytes(args.shard_size),
        codec=args.codec,
        workers=args.workers or None,
        overwrite=args.overwrite,
        progress=sys.stderr.isatty(),
        shuffle=not args.no_shuffle,
        seed=args.seed,
        skip_corrupt=args.skip_corrupt,
    )
    for index in result.values() if isinstance(result, dict) else [result]:
        skipped = f"; skipped {len(index.skipped)} unreadable images" if index.skipped else ""
        print(
            f"packed {index.num_samples:,} samples into {len(index.shards)} shards "
            f"({format_bytes(index.nbytes)}) at {index.root}{skipped}"
        )
    return 0


def cmd_inspect(argv: Sequence[str]) -> int:
    """``kaisoku inspect PATH [--verify]``."""
    # start-up: each command imports only what it runs
    from kaisoku.data.shards.inspect import inspect_dataset

    parser = CommandParser(
        prog="kaisoku inspect",
        description="Summarise a packed dataset; --verify checks every shard size and record checksum.",
    )
    parser.add_argument("path", help="packed dataset directory, its index.json, or a directory of splits")
    parser.add_argument("--verify", action="store_true", help="check every record's CRC32")
    args = parser.parse_args(list(argv))
    report = inspect_dataset(args.path, verify=args.verify)
    print(report.text)
    if report.problems:
        raise KaisokuError(
            f"{args.path}: {report.count:,} verification problems, first: {report.problems[0]}"
        )
    return 0


def cmd_report(argv: Sequence[str]) -> int:
    """``kaisoku report RUN_DIR``."""
    # start-up: each command imports only what it runs
    from kaisoku.engine.report import write_report

    parser = CommandParser(
        prog="kaisoku report",
        description="Write RUN_DIR/report.html: plots of the run's metrics, its events, config and environment.",
    )
    parser.add_argument("run_dir", help="a run folder (finished or crashed)")
    args = parser.parse_args(list(argv))
    print(f"wrote {write_report(args.run_dir)}")
    return 0


def cmd_probe(argv: Sequence[str]) -> int:
    """``kaisoku probe PATH [--out machine.toml] [--seconds S]``; ``--train CONFIG`` is read as ``kaisoku train
    --config CONFIG`` reads it."""
    from kaisoku.plan.probe_command import cmd_probe as run  # start-up: loaded only when this command runs

    return run(argv, train_config=lambda path: resolve_config(["--config", path])[0])


def cmd_plan(argv: Sequence[str]) -> int:
    """``kaisoku plan --cluster C.toml --dataset D [--nodes N] [--au 0.9] [--json] [--plot FILE.png]``."""
    from kaisoku.plan.command import cmd_plan as run  # start-up: loaded only when this command runs

    return run(argv)


def cmd_ckpt(argv: Sequence[str]) -> int:
    """``kaisoku ckpt convert SRC DEST`` and ``kaisoku ckpt verify PATH``."""
    from pathlib import Path

    # start-up: each command imports only what it runs
    from kaisoku.engine.ckpt_convert import convert_checkpoint, verify_checkpoints

    parser = CommandParser(prog="kaisoku ckpt", description="Work on checkpoints.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    convert = actions.add_parser(
        "convert",
        help="sharded checkpoint folder <-> single-file checkpoint",
        description=(
            "Convert a sharded checkpoint folder (step-XXXXXXXX/, written under --parallel.shard) into one "
            "single-file checkpoint (step-XXXXXXXX.pt), or a single-file checkpoint into a sharded folder. "
            "Either resumes the same run exactly with --resume DEST, on any layout."
        ),
    )
    convert.add_argument("src", help="a checkpoint folder or .pt file")
    convert.add_argument("dest", help="where the other form goes (must not exist)")
    verify = actions.add_parser(
        "verify",
        help="check checkpoints against their content checksums",
        description=(
            "Check a checkpoint (a step-XXXXXXXX.pt file or step-XXXXXXXX/ folder), or every checkpoint of a "
            "run folder, against the content checksums written with it: one line each; exit 3 when any is "
            "damaged (--resume auto skips those)."
        ),
    )
    verify.add_argument("path", help="a checkpoint file or folder, or a run folder")
    args = parser.parse_args(list(argv))
    if args.action == "verify":
        lines, sound = verify_checkpoints(Path(args.path))
        print("\n".join(lines))
        return 0 if sound else 3
    print(convert_checkpoint(Path(args.src), Path(args.dest)))
    return 0


_COMMANDS = {
    "train": cmd_train,
    "pack": cmd_pack,
    "inspect": cmd_inspect,
    "datagen": cmd_datagen,
    "bench": cmd_bench,
    "report": cmd_report,
    "probe": cmd_probe,
    "plan": cmd_plan,
    "ckpt": cmd_ckpt,
}

_SUMMARIES = {
    "train": "train a model (alone: the embedded default, a small ResNet on generated shapes)",
    "pack": "pack an image folder or a .npz into checksummed shards with an index",
    "inspect": "summarise a packed dataset; --verify checks every record's checksum",
    "datagen": "write the generated shapes set (or CosmoFlow universes) to a folder",
    "bench": "run a benchmark and record it (see benchmarks/README.md)",
    "report": "write RUN_DIR/report.html: a run's plots, events, config and environment",
    "probe": "measure a file system and this node's disk and RAM into a cluster profile",
    "plan": "predict epoch time of each data strategy on a cluster and recommend one",
    "ckpt": "verify checkpoints, or convert a sharded folder into one file and back (kaisoku ckpt verify|convert)",
}
"""One line per command for ``kaisoku --help``."""


def usage() -> str:
    """The text of ``kaisoku --help`` (and of a bare ``kaisoku``): each command with one line."""
    width = max(len(name) for name in _COMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {_SUMMARIES[name]}" for name in _COMMANDS)
    return (
        f"usage: kaisoku COMMAND [ARGS ...]\n\n"
        f"kaisoku {__version__}: fast deep-learning training on PyTorch.\n\n"
        f"commands:\n{rows}\n\n"
        "kaisoku COMMAND --help lists a command's options; kaisoku --version prints the version."
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``kaisoku`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0)
    if argv[0] in ("-V", "--version"):
        print(f"kaisoku {__version__}")
        sys.exit(0)
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(
            f"kaisoku: unknown command '{command}'; choose one of: {', '.join(_COMMANDS)} (see kaisoku --help)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        code = _COMMANDS[command](rest)
    except KaisokuError as error:
        print(f"kaisoku: error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print("kaisoku: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
