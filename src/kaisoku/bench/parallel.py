"""``kaisoku bench parallel``: pipeline bubble, hybrid layouts on 4 ranks, and switch-parallel on MNIST.

(a) Bubble: pp=2 on 2 ranks (one thread each), m in {2, 4, 8} micro-batches, GPipe and 1F1B. The bubble
    of a rank is the time it spends blocked in the schedule's point-to-point waits (plus, for the rank
    that finishes first, the wait for the pipeline to drain) divided by the step time, averaged over the
    two ranks, beside the theory (p - 1) / (m + p - 1). Goal: 1F1B within 25% of the theory at every m.
(b) 4 ranks, functional rows: samples/s and per-rank peak memory (ru_maxrss) for dp4, dp2xpp2 and pp4
    training a small ResNet; no goal (4 ranks share 2 cores here).
(c) MNIST test accuracy after a fixed budget for dp only (dp4), hybrid only (dp2xpp2) and switch (dp2xpp2,
    then dp4), several seeds, mean and std. Goal: switch's mean accuracy within one std of dp-only's, and
    its samples/s above dp-only's wherever hybrid's is.

Each configuration runs in its own group of processes with a file:// rendezvous, one thread per rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from kaisoku.bench.common import goal, locate_mnist, print_table, write_result
from kaisoku.distributed.mesh import ParallelLayout, ParallelMesh, build_mesh
from kaisoku.distributed.pipeline import HybridOptions, HybridParallel, replica_batch_slice
from kaisoku.distributed.switch import parse_switch_schedule, switch_layout

NAME = "parallel"

_CONTEXT = mp.get_context("forkserver")
# Ranks fork from a server that imported torch and the pipelining package once (importing pipelining
# costs seconds per process otherwise). A server already started elsewhere keeps its own preload.
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.pipelining", "kaisoku"])


# --------------------------------------------------------------------------------------------------
# Launching ranks.
# --------------------------------------------------------------------------------------------------


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, tmp: str, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    out = Path(tmp) / f"result_{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-") as tmp:
        procs = [
            _CONTEXT.Process(target=_rank_main, args=(fn, rank, world_size, tmp, args))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        end = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        results = []
        for rank in range(world_size):
            path = Path(tmp) / f"result_{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {rank} left no result (exit code {procs[rank].exitcode})")
            record = torch.load(path, weights_only=False)
            if not record["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{record['error']}")
            results.append(record["result"])
        return results


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _SGDFactory:
    """A picklable optimizer factory: SGD with momentum 0.9."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __call__(self, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        """Build the optimizer over ``named`` parameters."""
        return torch.optim.SGD([p for _, p in named], lr=self.lr, momentum=0.9)


# --------------------------------------------------------------------------------------------------
# (a) bubble.
# --------------------------------------------------------------------------------------------------


def _bubble_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Sequential(nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _bubble_rank(
    rank: int, world_size: int, width: int, depth: int, micro_size: int, ms: list[int], rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """Per configuration "schedule/m": one (blocked seconds, step seconds) pair per measured step."""
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
    for schedule in ("gpipe", "1f1b"):
        for m in ms:
            runs[f"{schedule}/{m}"] = _bubble_step(schedule, m, mesh, width, depth, micro_size, blocked)
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
    schedule: str, m: int, mesh: ParallelMesh, width: int, depth: int, micro_size: int, blocked: list[float]
) -> Callable[[], tuple[float, float]]:
    hybrid = HybridParallel(
        _bubble_model(width, depth),
        mesh,
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=_SGDFactory(0.01),
        options=HybridOptions(microbatches=m, schedule=schedule),
    )
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m * micro_size, width, generator=generator)
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
    over the faster half of the steps (by the slower rank's step time), the steps least disturbed by
    other processes on the machine.
    """
    ms = [2, 4, 8]
    width, depth, micro_size = 1024, 8, 128
    rounds = 3 if quick else 12
    per_rank = launch(_bubble_rank, 2, width, depth, micro_size, ms, rounds)
    rows = []
    p = 2
    for name in per_rank[0]:
        schedule, m_text = name.split("/")
        m = int(m_text)
        steps = list(zip(*(rank_result[name] for rank_result in per_rank)))
        step_seconds = [max(elapsed for _, elapsed in step) for step in steps]
        fractions = [statistics.mean(b / e for b, e in step) for step in steps]
        calm = sorted(range(len(steps)), key=lambda i: step_seconds[i])[: max(1, (len(steps) + 1) // 2)]
        bubble = statistics.median(fractions[i] for i in calm)
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
                "bubble_all_steps": round(statistics.median(fractions), 4),
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
    rank: int, world_size: int, layout_text: str, batch: int, microbatches: int, steps: int
) -> dict[str, Any]:
    baseline = _peak_rss_mib()
    layout = ParallelLayout.parse(layout_text)
    hybrid = HybridParallel(
        _small_resnet(),
        build_mesh(layout),
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=_SGDFactory(0.01),
        options=HybridOptions(microbatches=microbatches, schedule="1f1b"),
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (batch,), generator=generator)
    part = replica_batch_slice(batch, hybrid.dp_index, hybrid.dp_size)
    xs, ys = x[part], y[part]
    hybrid.train_step(xs, ys)  # builds the schedule
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        hybrid.train_step(xs, ys)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {
        "samples_per_s": batch * steps / elapsed,
        "peak_rss_mib": _peak_rss_mib(),
        "baseline_rss_mib": baseline,
        "parameters": sum(p.numel() for _, p in hybrid.named_parameters),
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
# (c) MNIST: dp only, hybrid only, switch.
# --------------------------------------------------------------------------------------------------


def _mnist_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 1024),
        nn.BatchNorm1d(1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.BatchNorm1d(1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def _load_mnist(path: Path, train_limit: int | None) -> tuple[torch.Tensor, ...]:
    with np.load(path, allow_pickle=False) as archive:
        x_train, y_train = archive["x_train"], archive["y_train"]
        x_test, y_test = archive["x_test"], archive["y_test"]
    if train_limit is not None:
        x_train, y_train = x_train[:train_limit], y_train[:train_limit]

    def prepare(x: np.ndarray) -> torch.Tensor:
        return ((torch.from_numpy(x.astype(np.float32)) / 255.0) - 0.1307) / 0.3081

    return (
        prepare(x_train),
        torch.from_numpy(y_train.astype(np.int64)),
        prepare(x_test),
        torch.from_numpy(y_test.astype(np.int64)),
    )


def _mnist_run(
    schedule_text: str,
    meshes: dict[str, ParallelMesh],
    data: tuple[torch.Tensor, ...],
    seed: int,
    epochs: int,
    batch: int,
    microbatches: int,
) -> dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    plan = parse_switch_schedule(schedule_text)
    layout = plan.layout_at(0)
    hybrid = HybridParallel(
        _mnist_model(seed),
        meshes[str(layout)],
        loss_fn=nn.functional.cross_entropy,
        optimizer_factory=_SGDFactory(0.05),
        options=HybridOptions(microbatches=microbatches, schedule="1f1b"),
    )
    steps_per_epoch = x_train.shape[0] // batch
    dist.barrier()
    start = time.perf_counter()
    last_loss = float("nan")
    for epoch in range(epochs):
        following = plan.switch_at(epoch)
        if following is not None:
            hybrid = switch_layout(hybrid, meshes[str(following)])
        # Sample order keyed by (seed, epoch) only; a replica takes its slice of each global batch.
        order = torch.from_numpy(np.random.default_rng((seed, epoch)).permutation(x_train.shape[0]))
        part = replica_batch_slice(batch, hybrid.dp_index, hybrid.dp_size)
        for step in range(steps_per_epoch):
            index = order[step * batch : (step + 1) * batch][part]
            last_loss = hybrid.train_step(x_train[index], y_train[index])
    dist.barrier()
    elapsed = time.perf_counter() - start
    hybrid.full_state_dict()
    hybrid.close()
    # Every rank holds the gathered model; each scores a quarter of the test set.
    model = hybrid.model.eval()
    share = torch.arange(dist.get_rank(), len(y_test), dist.get_world_size())
    with torch.no_grad():
        correct = torch.tensor(
            [sum(int((model(x_test[i]).argmax(1) == y_test[i]).sum()) for i in share.split(1000))]
        )
    dist.all_reduce(correct)
    return {
        "accuracy": int(correct.item()) / len(y_test),
        "samples_per_s": steps_per_epoch * batch * epochs / elapsed,
        "final_loss": last_loss,
    }


def _mnist_rank(
    rank: int,
    world_size: int,
    path: str,
    configs: dict[str, str],
    seeds: list[int],
    epochs: int,
    batch: int,
    microbatches: int,
    train_limit: int | None,
) -> list[dict[str, Any]]:
    data = _load_mnist(Path(path), train_limit)
    meshes = {text: build_mesh(ParallelLayout.parse(text)) for text in ("dp4", "dp2xpp2")}
    rows = []
    names = list(configs)
    for seed_index, seed in enumerate(seeds):
        # Rotate the order of the configurations so that none always runs first.
        shift = seed_index % len(names)
        for name in names[shift:] + names[:shift]:
            result = _mnist_run(configs[name], meshes, data, seed, epochs, batch, microbatches)
            rows.append({"config": name, "schedule": configs[name], "seed": seed, **result})
    return rows


def bench_mnist(quick: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of (c), one per (configuration, seed), and the per-configuration aggregates."""
    path = locate_mnist()
    if path is None:
        return [{"part": "mnist", "config": "all", "skipped": "mnist.npz not found (set KAISOKU_MNIST)"}], {}
    epochs = 2
    configs = {
        "dp-only": "dp4",
        "hybrid-only": "dp2xpp2",
        "switch": f"dp2xpp2:0-{epochs // 2},dp4:{epochs // 2}-",
    }
    seeds = [0, 1] if quick else [0, 1, 2]
    train_limit = 1536 if quick else None
    raw = launch(_mnist_rank, 4, str(path), configs, seeds, epochs, 128, 4, train_limit)[0]
    rows = [
        {"part": "mnist", **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}}
        for r in raw
    ]
    aggregate: dict[str, Any] = {}
    for name in configs:
        accuracies = [r["accuracy"] for r in raw if r["config"] == name]
        speeds = [r["samples_per_s"] for r in raw if r["config"] == name]
        aggregate[name] = {
            "schedule": configs[name],
            "accuracy_mean": statistics.mean(accuracies),
            "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
            "samples_per_s_mean": statistics.mean(speeds),
            "seeds": seeds,
            "epochs": epochs,
            "train_samples": train_limit or 50000,
        }
    return rows, aggregate


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
                f"{mnist[n]['samples_per_s_mean']:.0f}/s",
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
    started = time.perf_counter()
    bubble = bench_bubble(quick)
    layouts = bench_layouts(quick)
    mnist_rows, mnist = bench_mnist(quick)
    summary: dict[str, dict[str, Any]] = {}
    one_f_one_b = [r for r in bubble if r["schedule"] == "1f1b"]
    summary["bubble_1f1b_worst_relative_gap"] = goal(
        max(abs(r["ratio"] - 1.0) for r in one_f_one_b), "<= 0.25"
    )
    notes = [
        "bubble = (seconds blocked in the schedule's p2p waits + the drain wait at the step's end) / step "
        "seconds, mean of the 2 ranks, median over the faster half of the steps (the least disturbed)",
        "4 ranks share the machine's cores in (b) and (c): samples/s compare layouts, not hardware",
    ]
    extra: dict[str, Any] = {
        "setup": {
            "bubble": "2 ranks, 1 thread each; 8 x (Linear(1024,1024)+ReLU) + Linear(1024,10); 128 samples "
            "per micro-batch; split by parameters (4 blocks a stage)",
            "layouts": "4 ranks; torchvision ResNet(BasicBlock, [1,1,1,1]) on 3x32x32, global batch 32, "
            "1f1b with 4 micro-batches; SGD momentum 0.9",
            "mnist": "4 ranks; MLP 784-1024-BN-ReLU-1024-BN-ReLU-10; SGD lr 0.05 momentum 0.9; global batch "
            "128; 1f1b with 4 micro-batches in dp2xpp2; sample order keyed by (seed, epoch); full test set",
        },
        "mnist": mnist,
    }
    if mnist:
        dp, hybrid, switch = mnist["dp-only"], mnist["hybrid-only"], mnist["switch"]
        gap = abs(switch["accuracy_mean"] - dp["accuracy_mean"])
        summary["switch_accuracy_gap_in_dp_stds"] = goal(gap / max(dp["accuracy_std"], 1e-9), "<= 1.0")
        hybrid_speedup = hybrid["samples_per_s_mean"] / dp["samples_per_s_mean"]
        switch_speedup = switch["samples_per_s_mean"] / dp["samples_per_s_mean"]
        extra["hybrid_speedup_vs_dp"] = round(hybrid_speedup, 4)
        extra["switch_speedup_vs_dp"] = round(switch_speedup, 4)
        if hybrid_speedup > 1.0:
            summary["switch_speedup_vs_dp"] = goal(switch_speedup, "> 1.0")
        else:
            notes.append(
                f"hybrid did not beat dp-only here (x{hybrid_speedup:.3f}), so the switch speed goal does not apply"
            )
    rows = bubble + layouts + mnist_rows
    extra["seconds"] = round(time.perf_counter() - started, 1)
    record = write_result(NAME, out_dir, summary, rows, quick=quick, notes="; ".join(notes), extra=extra)
    _plot(bubble, layouts, mnist, out_dir / f"{NAME}.png")
    parts = {"(a) bubble, pp=2": bubble, "(b) 4 ranks": layouts, "(c) MNIST": mnist_rows}
    for title, part_rows in parts.items():
        shown = [{k: v for k, v in row.items() if k != "part"} for row in part_rows]
        goals = {k: v for k, v in summary.items() if k.startswith("bubble") == title.startswith("(a)")}
        if title.startswith("(b)"):
            goals = {}
        print_table(f"parallel {title}", shown, goals)
    return record
