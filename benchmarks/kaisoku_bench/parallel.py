"""``kaisoku bench parallel``: pipeline bubble, hybrid layouts on 4 ranks, and switch-parallel on MNIST.

(a) the measured 1F1B and GPipe bubble at pp=2 against (p - 1) / (m + p - 1); (b) samples/s and peak
memory of dp4, dp2xpp2 and pp4 (no goal); (c) dp only, hybrid only and switch on MNIST through
``build_trainer`` (:mod:`kaisoku_bench.parallel_mnist`). Each part runs on its own group of gloo ranks
(:func:`~kaisoku.distributed.spawn.run_ranks`). Setup and goals: ``benchmarks/README.md``, section parallel.
"""

from __future__ import annotations

import functools
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kaisoku.config import OptimConfig
from kaisoku.distributed.data_parallel import BucketPlan, wrap_ddp
from kaisoku.distributed.mesh import ParallelLayout, ParallelMesh, build_mesh
from kaisoku.distributed.pipeline import HybridOptions, HybridParallel, replica_batch_slice
from kaisoku.distributed.spawn import run_ranks
from kaisoku.optim.factory import build_optimizer_from_named
from kaisoku_bench.common import locate_mnist, print_table, write_result
from kaisoku_bench.goals import Interval, bootstrap_interval, worst_of
from kaisoku_bench.parallel_mnist import bench_mnist, mnist_goals

NAME = "parallel"


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 1800.0) -> list[Any]:
    """Run ``fn(rank, world_size, tmp, *args)`` on ``world_size`` gloo ranks; return each rank's result."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-parallel-") as tmp:
        return run_ranks(fn, world_size, Path(tmp), *args, timeout=timeout, collective_timeout=300.0)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _sgd_factory(lr: float) -> Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]:
    """The library's optimizer factory of a pipeline stage (picklable): SGD, momentum 0.9, no weight decay."""
    return functools.partial(
        build_optimizer_from_named,
        cfg=OptimConfig(name="sgd", lr=lr, weight_decay=0.0, no_decay_bn_bias=False),
    )


# --------------------------------------------------------------------------------------------------
# (a) bubble.
# --------------------------------------------------------------------------------------------------


def _bubble_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Sequential(nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class _BubbleMLP:
    """A picklable model factory: depth x (Linear(width, width) + ReLU) + Linear(width, 10), seeded."""

    def __init__(self, width: int, depth: int) -> None:
        self.width, self.depth = width, depth

    def __call__(self) -> nn.Module:
        """A fresh copy of the model."""
        return _bubble_model(self.width, self.depth)


def bubble_rank(
    rank: int,
    world_size: int,
    tmp: Path,
    width: int,
    depth: int,
    micro_size: int,
    ms: list[int],
    rounds: int,
    make_model: Callable[[], nn.Module] | None = None,
    sample_shape: tuple[int, ...] | None = None,
    schedule_names: tuple[str, ...] = ("gpipe", "1f1b"),
) -> dict[str, list[tuple[float, float]]]:
    """Per configuration "schedule/m": one (blocked seconds, step seconds) pair per measured step.

    The model is ``make_model()`` on inputs of ``sample_shape`` (default: the MLP of ``width`` and
    ``depth`` on vectors of ``width``); ``kaisoku bench vit`` measures a vision transformer this way.
    """
    from torch.distributed.pipelining import schedules

    blocked = [0.0]
    original_wait = schedules._wait_batch_p2p

    def timed_wait(work: Any) -> None:
        start = time.perf_counter()
        original_wait(work)
        blocked[0] += time.perf_counter() - start

    # Measurement only: count the seconds the schedule spends waiting on its point-to-point operations.
    schedules._wait_batch_p2p = timed_wait
    mesh = build_mesh(ParallelLayout(1, 2))
    runs: dict[str, Callable[[], tuple[float, float]]] = {}
    make_model = make_model or _BubbleMLP(width, depth)
    shape = sample_shape or (width,)
    for schedule in schedule_names:
        for m in ms:
            runs[f"{schedule}/{m}"] = _bubble_step(schedule, m, mesh, make_model, shape, micro_size, blocked)
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    names = list(runs)
    for name in names:
        runs[name]()  # the first step builds the schedule
    # Rounds rotate through the configurations so that a busy spell of the machine hits them all alike.
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            measured[name].append(runs[name]())
    schedules._wait_batch_p2p = original_wait
    return measured


def _bubble_step(
    schedule: str,
    m: int,
    mesh: ParallelMesh,
    make_model: Callable[[], nn.Module],
    shape: tuple[int, ...],
    micro_size: int,
    blocked: list[float],
) -> Callable[[], tuple[float, float]]:
    hybrid = HybridParallel(
        make_model(),
        mesh,
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=_sgd_factory(0.01),
        options=HybridOptions(microbatches=m, schedule=schedule),
    )
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m * micro_size, *shape, generator=generator)
    y = torch.randint(0, 10, (m * micro_size,), generator=generator)

    def step() -> tuple[float, float]:
        dist.barrier()
        blocked[0] = 0.0
        start = time.perf_counter()
        hybrid.pipeline_step(x, y)
        done = time.perf_counter()
        # A rank that finishes early (the last stage, whose backward ends first) waits for the pipeline
        # to drain: idle time of the step too, spent here in a barrier rather than in a receive.
        dist.barrier()
        end = time.perf_counter()
        hybrid.optimizer.zero_grad(set_to_none=True)
        return blocked[0] + (end - done), end - start

    return step


def bench_bubble(quick: bool) -> list[dict[str, Any]]:
    """Rows of (a): measured bubble per schedule and m beside the theory.

    A step's bubble is the mean over the two ranks of blocked / step seconds; the figure is the median
    over every step (the median over the faster half, the steps least disturbed by other processes, is
    kept beside it for reference, not judged: keeping only the fast steps favours the schedule).
    """
    ms = [2, 4, 8]
    width, depth, micro_size = 1024, 8, 128
    rounds = 3 if quick else 12
    return bubble_rows(launch(bubble_rank, 2, width, depth, micro_size, ms, rounds))


def bubble_goal(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``bubble_1f1b_worst_relative_gap``: over m, the largest |measured / theory - 1| of the 1F1B rows
    (the sign stays in each row's ``ratio``), each m's interval from the bootstrap of its per-step ratios:
    the gap's interval is the distance of that ratio interval from 1 (0 where it holds 1)."""
    cases: dict[str, tuple[float, Interval | None]] = {}
    for row in rows:
        if row["schedule"] != "1f1b":
            continue
        ratios = row.get("ratio_per_step") or []
        interval = None
        if len(ratios) >= 2:
            around = bootstrap_interval(ratios, unit="steps")
            near = 0.0 if around.low <= 1.0 <= around.high else min(abs(around.low - 1), abs(around.high - 1))
            far = max(abs(around.low - 1), abs(around.high - 1))
            interval = Interval(near, far, f"|x - 1| of the {around.method}")
        cases[f"m={row['m']}"] = (abs(row["ratio"] - 1.0), interval)
    return worst_of(cases, "<= 0.25")


def bubble_rows(per_rank: list[dict[str, list[tuple[float, float]]]]) -> list[dict[str, Any]]:
    """The rows of :func:`bench_bubble` from each rank's :func:`bubble_rank` result (pp=2)."""
    rows = []
    p = 2
    for name in per_rank[0]:
        schedule, m_text = name.split("/")
        m = int(m_text)
        steps = list(zip(*(rank_result[name] for rank_result in per_rank)))
        step_seconds = [max(elapsed for _, elapsed in step) for step in steps]
        fractions = [statistics.mean(b / e for b, e in step) for step in steps]
        calm = sorted(range(len(steps)), key=lambda i: step_seconds[i])[: max(1, (len(steps) + 1) // 2)]
        bubble = statistics.median(fractions)
        theory = (p - 1) / (m + p - 1)
        rows.append(
            {
                "part": "bubble",
                "schedule": schedule,
                "pp": p,
                "m": m,
                "bubble": round(bubble, 4),
                "theory": round(theory, 4),
                "ratio": round(bubble / theory, 3),
                "ratio_per_step": [round(f / theory, 4) for f in fractions],
                "bubble_faster_half": round(statistics.median(fractions[i] for i in calm), 4),
                "step_s": round(min(step_seconds), 4),
            }
        )
    return rows


# --------------------------------------------------------------------------------------------------
# (b) 4 ranks: samples/s and peak memory per layout.
# --------------------------------------------------------------------------------------------------


def _small_resnet() -> nn.Module:
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(0)
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _layout_rank(
    rank: int, world_size: int, tmp: Path, layout_text: str, batch: int, microbatches: int, steps: int
) -> dict[str, Any]:
    baseline = _peak_rss_mib()
    layout = ParallelLayout.parse(layout_text)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    step: Callable[[torch.Tensor, torch.Tensor], Any]
    if layout.pp == 1:  # plain data parallelism: what kaisoku train builds (DDP, kaisoku's bucket plan)
        model = wrap_ddp(_small_resnet(), torch.device("cpu"), plan=BucketPlan())
        optimizer = _sgd_factory(0.01)(list(model.named_parameters()))
        part = replica_batch_slice(batch, rank, world_size)
        parameters = sum(p.numel() for p in model.parameters())

        def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
            nn.functional.cross_entropy(model(xs), ys).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    else:
        hybrid = HybridParallel(
            _small_resnet(),
            build_mesh(layout),
            loss_fn=nn.functional.cross_entropy,
            optimizer_factory=_sgd_factory(0.01),
            options=HybridOptions(microbatches=microbatches, schedule="1f1b"),
        )
        part = replica_batch_slice(batch, hybrid.dp_index, hybrid.dp_size)
        parameters = sum(p.numel() for _, p in hybrid.named_parameters)
        step = hybrid.train_step
    xs, ys = x[part], y[part]
    step(xs, ys)  # builds the schedule or DDP's buckets
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step(xs, ys)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {
        "samples_per_s": batch * steps / elapsed,
        "peak_rss_mib": _peak_rss_mib(),
        "baseline_rss_mib": baseline,
        "parameters": parameters,
    }


def bench_layouts(quick: bool) -> list[dict[str, Any]]:
    """Rows of (b): one 4-rank run per layout."""
    batch = 32
    steps = 2 if quick else 8
    rows = []
    for layout_text in ("dp4", "dp2xpp2", "pp4"):
        per_rank = launch(_layout_rank, 4, layout_text, batch, 4, steps)
        rows.append(
            {
                "part": "layouts",
                "layout": layout_text,
                "engine": "DDP, kaisoku bucket plan" if layout_text == "dp4" else "pipeline (1f1b)",
                "model": "resnet-1111",
                "global_batch": batch,
                "samples_per_s": round(min(r["samples_per_s"] for r in per_rank), 2),
                "peak_rss_mib_per_rank": [round(r["peak_rss_mib"]) for r in per_rank],
                "rss_growth_mib_per_rank": [
                    round(r["peak_rss_mib"] - r["baseline_rss_mib"]) for r in per_rank
                ],
                "trained_params_per_rank": [r["parameters"] for r in per_rank],
            }
        )
    return rows


# --------------------------------------------------------------------------------------------------
# The record.
# --------------------------------------------------------------------------------------------------


def _plot(
    bubble: list[dict[str, Any]], layouts: list[dict[str, Any]], mnist: dict[str, Any], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ms = sorted({r["m"] for r in bubble})
    ax.plot(ms, [1 / (m + 1) for m in ms], "k--", label="theory (p-1)/(m+p-1)")
    for schedule, marker in (("gpipe", "o"), ("1f1b", "s")):
        points = [r for r in bubble if r["schedule"] == schedule]
        ax.plot([r["m"] for r in points], [r["bubble"] for r in points], marker=marker, label=schedule)
    ax.set(xlabel="micro-batches m", ylabel="bubble (blocked / step)", title="(a) pp=2 bubble", xticks=ms)
    ax.legend()
    ax = axes[1]
    if layouts:
        names = [r["layout"] for r in layouts]
        ax.bar(names, [r["samples_per_s"] for r in layouts], color="tab:blue")
        ax.set(ylabel="samples/s", title="(b) 4 ranks, small ResNet")
        twin = ax.twinx()
        twin.plot(names, [max(r["rss_growth_mib_per_rank"]) for r in layouts], "ro-", label="max rank")
        twin.plot(names, [min(r["rss_growth_mib_per_rank"]) for r in layouts], "r^--", label="min rank")
        twin.set_ylabel("peak RSS growth while training (MiB)", color="tab:red")
        twin.legend(loc="upper right")
    ax = axes[2]
    if mnist:
        names = list(mnist)
        ax.bar(
            names,
            [100 * mnist[n]["accuracy_mean"] for n in names],
            yerr=[100 * mnist[n]["accuracy_std"] for n in names],
            capsize=6,
            color="tab:green",
        )
        low = min(100 * (mnist[n]["accuracy_mean"] - 3 * mnist[n]["accuracy_std"]) for n in names)
        ax.set_ylim(max(0.0, low - 0.5), 100)
        for i, n in enumerate(names):
            ax.annotate(
                f"{mnist[n]['samples_per_s_median']:.0f}/s",
                (i, max(0.0, low - 0.5) + 0.2),
                ha="center",
                va="bottom",
                color="white",
            )
        ax.set(ylabel="test accuracy (%) mean ± std", title="(c) MNIST, 4 ranks")
    else:
        ax.text(0.5, 0.5, "MNIST not found", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure (a), (b) and (c); write ``parallel.json`` and ``parallel.png`` into ``out_dir``."""
    bubble = bench_bubble(quick)
    layouts = bench_layouts(quick)
    mnist_path = locate_mnist()
    mnist_rows, mnist = bench_mnist(quick, mnist_path)
    summary = {
        "bubble_1f1b_worst_relative_gap": bubble_goal(bubble),
        **mnist_goals(
            mnist, "" if mnist_path else "mnist.npz not found (pass --mnist PATH or set KAISOKU_MNIST)"
        ),
    }
    notes = [
        "bubble = (seconds blocked in the schedule's p2p waits + the drain wait at the step's end) / step "
        "seconds, mean of the 2 ranks, median over every step (bubble_faster_half: over the faster half, "
        "for reference)",
        "4 ranks share the machine's cores in (b) and (c): samples/s compare layouts, not hardware",
        "(c) speed figures: per seed, a configuration's samples/s (slowest rank, Trainer.fit's training "
        "time) over dp-only's; median and range over the seeds",
    ]
    extra: dict[str, Any] = {
        "setup": {
            "bubble": "2 ranks, 1 thread each; 8 x (Linear(1024,1024)+ReLU) + Linear(1024,10); 128 samples "
            "per micro-batch; split by parameters (4 blocks a stage)",
            "layouts": "4 ranks; torchvision ResNet(BasicBlock, [1,1,1,1]) on 3x32x32, global batch 32; dp4: "
            "DDP with kaisoku's bucket plan; dp2xpp2 and pp4: 1f1b with 4 micro-batches; SGD momentum 0.9",
            "mnist": "4 ranks; build_trainer + Trainer.fit on the packed archive; small-cnn; SGD lr 0.05 "
            "momentum 0.9, constant; global batch 128; 1f1b with 4 micro-batches in dp2xpp2; "
            "2 epochs (switch: dp2xpp2 then dp4); no DataLoader workers; accuracy on the test split",
        },
        "mnist": mnist,
    }
    rows = bubble + layouts + mnist_rows
    record = write_result(NAME, out_dir, summary, rows, quick=quick, notes="; ".join(notes), extra=extra)
    _plot(bubble, layouts, mnist, out_dir / f"{NAME}.png")
    parts = {"(a) bubble, pp=2": bubble, "(b) 4 ranks": layouts, "(c) MNIST": mnist_rows}
    for title, part_rows in parts.items():
        shown = [{k: v for k, v in row.items() if k != "part"} for row in part_rows]
        goals = {k: v for k, v in summary.items() if k.startswith("bubble") == title.startswith("(a)")}
        print_table(f"parallel {title}", shown, {} if title.startswith("(b)") else goals)
    return record
