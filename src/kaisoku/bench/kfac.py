"""``kaisoku bench kfac``: wall time to 98% MNIST test accuracy for SGD, LARS and K-FAC on 2 CPU ranks.

A small BatchNorm CNN (``SmallCNN``, width 16) is trained data-parallel (DDP, gloo, one thread per rank)
at global batch 2,048 by three methods sharing one 3-point learning-rate grid: momentum SGD, LARS
(``kaisoku.optim.LARS``; Nesterov momentum SGD where that is absent) and K-FAC in front of momentum SGD.
Each method's learning rate is picked on ``x_val`` after a shortened run (one epoch); then each method
trains from the same initial weights and data order until the test accuracy reaches 98% (evaluated every
few steps, evaluation time excluded), repeated with the methods interleaved; the median wall time counts.
The K-FAC step time is split into forward/backward, factor statistics, decomposition, communication and
preconditioning. ASDL (``asdl``) runs single-process on the same model where it is installed.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import multiprocessing as mp
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisoku.bench.common import goal, locate_mnist, median_iqr, print_table, write_result
from kaisoku.optim.kfac import KFAC

WORLD_SIZE = 2
GLOBAL_BATCH = 2048
TARGET_ACCURACY = 0.98


@dataclass(frozen=True)
class Plan:
    """What one invocation measures."""

    lr_grid: tuple[float, ...]
    grid_steps: int
    max_epochs: float
    eval_every: int
    repeats: int
    target: float
    global_batch: int = GLOBAL_BATCH
    train_limit: int | None = None
    eval_limit: int | None = None
    warmup_steps: int = 4
    seed: int = 0
    kfac_options: dict[str, Any] = field(default_factory=dict)


FULL_PLAN = Plan(
    lr_grid=(0.1, 0.2, 0.4),
    grid_steps=12,
    max_epochs=4,
    eval_every=6,
    repeats=2,
    target=TARGET_ACCURACY,
    kfac_options={
        "factor_update_steps": 3,
        "inv_update_steps": 6,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "kl_clip": 1e-3,
        "bn": "unit",
    },
)

QUICK_PLAN = Plan(
    lr_grid=(0.2,),
    grid_steps=0,
    max_epochs=1.5,
    eval_every=3,
    repeats=1,
    target=0.70,
    global_batch=512,
    train_limit=4096,
    eval_limit=1000,
    warmup_steps=2,
    kfac_options=dict(FULL_PLAN.kfac_options),
)


def second_method() -> tuple[str, str]:
    """``("lars", why)`` when ``kaisoku.optim.LARS`` exists, else ``("nesterov", why)``."""
    try:
        from kaisoku.optim import LARS  # noqa: F401
    except ImportError:
        return "nesterov", "kaisoku.optim.LARS is absent: Nesterov momentum SGD stands in for LARS"
    return "lars", "LARS: eta 0.02 with LARC clipping, no adaptation on BatchNorm and biases"


# ---------------------------------------------------------------------------------------------------------
# The model and the data.


def build_model() -> nn.Module:
    """The benchmarked model: ``SmallCNN`` of width 16 when available, else an equivalent local CNN."""
    try:
        from kaisoku.models.zoo import SmallCNN
    except ImportError:  # pragma: no cover - the model zoo ships with kaisoku
        return _fallback_cnn()
    return SmallCNN(width=16)


def _fallback_cnn() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)
        )

    return nn.Sequential(
        block(1, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)
    )


def _load(path: Path, plan: Plan) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    arrays = np.load(path, allow_pickle=False)
    splits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for split, limit in (("train", plan.train_limit), ("val", plan.eval_limit), ("test", plan.eval_limit)):
        x = arrays[f"x_{split}"][:limit]
        y = arrays[f"y_{split}"][:limit]
        images = (torch.from_numpy(x.astype(np.float32)) / 255.0 - 0.1307) / 0.3081
        splits[split] = (images.unsqueeze(1).contiguous(), torch.from_numpy(y.astype(np.int64)))
    return splits


def epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    """The global sample order of ``epoch``, keyed by (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)


# ---------------------------------------------------------------------------------------------------------
# One training run on this rank.


def _make_optimizer(method: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if method == "lars":
        from kaisoku.optim import LARS

        return LARS(model.named_parameters(), lr=lr, momentum=0.9, eta=0.02, trust_clip=True)
    if method == "nesterov":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


@torch.no_grad()
def _accuracy(model: nn.Module, split: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> float:
    model.eval()
    x, y = split
    share = math.ceil(len(x) / world)
    xs, ys = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    correct = 0
    for start in range(0, len(xs), 1000):
        logits = model(xs[start : start + 1000])
        correct += int((logits.argmax(1) == ys[start : start + 1000]).sum())
    model.train()
    total = torch.tensor([correct, len(xs)], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def train_run(
    method: str,
    lr: float,
    plan: Plan,
    data: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    *,
    max_steps: int | None,
    eval_split: str,
    stop_at_target: bool,
) -> dict[str, Any]:
    """Train one method from the seeded initial weights; return the accuracy curve and the time split."""
    torch.manual_seed(plan.seed)
    model = DistributedDataParallel(build_model())
    base_method = "sgd" if method == "kfac" else method
    optimizer = _make_optimizer(base_method, model.module, lr)
    kfac = KFAC(model, lr=optimizer, **plan.kfac_options) if method == "kfac" else None
    x_train, y_train = data["train"]
    per_rank = plan.global_batch // world
    steps_per_epoch = len(x_train) // plan.global_batch
    total_steps = int(plan.max_epochs * steps_per_epoch)
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    split_seconds = {"forward_backward": 0.0, "optimizer": 0.0}
    curve: list[dict[str, float]] = []
    wall = 0.0
    reached: dict[str, float] | None = None
    order = np.empty(0, dtype=np.int64)
    diverged = False
    for step in range(total_steps):
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0:
            order = epoch_order(plan.seed, epoch, len(x_train))
        batch = order[index * plan.global_batch : (index + 1) * plan.global_batch]
        mine = torch.from_numpy(batch[rank * per_rank : (rank + 1) * per_rank])
        x, y = x_train[mine], y_train[mine]
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / plan.warmup_steps)
        dist.barrier()
        t0 = time.perf_counter()
        hooks_before = kfac.timings.get("factor", 0.0) if kfac else 0.0
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        hooks = (kfac.timings.get("factor", 0.0) - hooks_before) if kfac else 0.0
        split_seconds["forward_backward"] += (t1 - t0) - hooks
        if kfac is not None:
            kfac.step()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        split_seconds["optimizer"] += t3 - t2
        wall += t3 - t0
        if not math.isfinite(float(loss.detach())):
            diverged = True
            break
        last = step == total_steps - 1
        if (step + 1) % plan.eval_every == 0 or last:
            # The inner module: evaluation needs no DDP buffer broadcast, so ranks may split unevenly.
            accuracy = _accuracy(model.module, data[eval_split], rank, world)
            point = {
                "step": step + 1,
                "epochs": (step + 1) / steps_per_epoch,
                "wall_s": wall,
                "acc": accuracy,
            }
            curve.append(point)
            if reached is None and accuracy >= plan.target:
                reached = point
                if stop_at_target:
                    break
    if rank == 0:
        print(
            f"  {method:9s} lr {lr:<6g} steps {step + 1:4d}  acc {curve[-1]['acc'] if curve else float('nan'):.4f}"
            f"  wall {wall:7.1f} s  reached {'yes' if reached else 'no'}",
            flush=True,
        )
    if kfac is not None:
        # The statistics hooks ran inside forward/backward and were taken out of it above; "factor" is
        # the hooks plus the running averages.
        timings = kfac.timings
        for phase in ("factor", "decomposition", "communication", "precondition"):
            split_seconds[phase] = timings.get(phase, 0.0)
    steps_run = max(1, curve[-1]["step"] if curve else 1)
    return {
        "method": method,
        "lr": lr,
        "curve": curve,
        "reached": reached,
        "diverged": diverged,
        "final_acc": curve[-1]["acc"] if curve else float("nan"),
        "step_split_ms": {k: 1000.0 * v / steps_run for k, v in split_seconds.items()},
        "steps": steps_run,
        "loads": kfac.rank_loads() if kfac else None,
    }


def _worker(rank: int, rendezvous: str, plan_dict: dict[str, Any], data_path: str, out: str) -> None:
    torch.set_num_threads(1)
    result_path = Path(out) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=WORLD_SIZE,
            timeout=datetime.timedelta(seconds=300),
        )
        plan = Plan(**{**plan_dict, "lr_grid": tuple(plan_dict["lr_grid"])})
        data = _load(Path(data_path), plan)
        # K-FAC right after SGD, so that a time limit cuts the peer rather than the compared pair.
        methods = ["sgd", "kfac", second_method()[0]]
        grid: list[dict[str, Any]] = []
        best: dict[str, float] = {}
        for method in methods:
            if plan.grid_steps > 0 and len(plan.lr_grid) > 1:
                scores = []
                for lr in plan.lr_grid:
                    run = train_run(
                        method, lr, plan, data, rank, WORLD_SIZE,
                        max_steps=plan.grid_steps, eval_split="val", stop_at_target=False,
                    )  # fmt: skip
                    grid.append({"method": method, "lr": lr, "val_acc": run["final_acc"]})
                    scores.append((-(run["final_acc"] if not run["diverged"] else -1.0), lr))
                best[method] = min(scores)[1]
            else:
                best[method] = plan.lr_grid[len(plan.lr_grid) // 2]
        runs: list[dict[str, Any]] = []
        for repeat in range(plan.repeats):
            shift = repeat % len(methods)
            for method in methods[shift:] + methods[:shift]:
                run = train_run(
                    method, best[method], plan, data, rank, WORLD_SIZE,
                    max_steps=None, eval_split="test", stop_at_target=True,
                )  # fmt: skip
                run["repeat"] = repeat
                runs.append(run)
                if rank == 0:
                    # What is done so far survives a time limit that stops the ranks.
                    partial = Path(out) / "rank0.partial.pt"
                    torch.save(
                        {"ok": True, "complete": False, "grid": grid, "best": best, "runs": runs}, partial
                    )
        dist.barrier()
        dist.destroy_process_group()
        torch.save({"ok": True, "complete": True, "grid": grid, "best": best, "runs": runs}, result_path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise


def _run_ranks(plan: Plan, data_path: Path, timeout_s: float) -> dict[str, Any]:
    context = mp.get_context("forkserver")
    # The fork server imports torch once; ranks then start as cheap forks of a process that never ran an
    # OpenMP region.
    context.set_forkserver_preload(["torch", "torch.distributed", "kaisoku"])
    with tempfile.TemporaryDirectory(prefix="kaisoku-kfac-") as tmp:
        procs = [
            context.Process(
                target=_worker, args=(rank, f"{tmp}/rendezvous", asdict(plan), str(data_path), tmp)
            )
            for rank in range(WORLD_SIZE)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        path = Path(tmp) / "rank0.pt"
        if not path.exists() and (Path(tmp) / "rank0.partial.pt").exists():
            path = Path(tmp) / "rank0.partial.pt"
        if not path.exists():
            codes = [proc.exitcode for proc in procs]
            raise RuntimeError(
                f"K-FAC benchmark ranks produced no result (exit codes {codes}, limit {timeout_s:.0f} s)"
            )
        record = torch.load(path, weights_only=False)
        if not record["ok"]:
            raise RuntimeError(f"K-FAC benchmark rank 0 failed:\n{record['error']}")
        return record


# ---------------------------------------------------------------------------------------------------------
# ASDL peer (single process), where installed.


#: ASDL has no KL clipping; with the damping K-FAC uses here (3e-3) its updates diverge within a few steps
#: on this model, 0.3 trains.
ASDL_DAMPING = 0.3
#: Wall-clock limit of the ASDL run (training and evaluation).
ASDL_TIME_LIMIT_S = 240.0


def _asdl_row(plan: Plan, data_path: Path, best_lr: float, quick: bool) -> dict[str, Any]:
    if importlib.util.find_spec("asdl") is None:
        return {"method": "asdl-kfac (1 process)", "status": "skipped: asdl (asdfghjkl) not installed"}
    if quick:
        return {
            "method": "asdl-kfac (1 process)",
            "status": "skipped in --quick (runs in the full benchmark)",
        }
    try:
        return _asdl_run(plan, data_path, best_lr)
    except Exception as error:  # a peer that fails to run is reported, not fatal
        return {"method": "asdl-kfac (1 process)", "status": f"failed: {type(error).__name__}: {error}"}


def _asdl_run(plan: Plan, data_path: Path, lr: float) -> dict[str, Any]:  # pragma: no cover - optional peer
    import asdl

    torch.manual_seed(plan.seed)
    data = _load(data_path, plan)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    config = asdl.PreconditioningConfig(
        data_size=plan.global_batch,
        damping=ASDL_DAMPING,
        curvature_upd_interval=plan.kfac_options.get("factor_update_steps", 1),
        preconditioner_upd_interval=plan.kfac_options.get("inv_update_steps", 10),
        ema_decay=1.0 - plan.kfac_options.get("factor_decay", 0.95),
    )
    gradmaker = asdl.KfacGradientMaker(model, config)
    x_train, y_train = data["train"]
    steps_per_epoch = len(x_train) // plan.global_batch
    wall, reached, acc = 0.0, None, float("nan")
    order = np.empty(0, dtype=np.int64)
    deadline = time.monotonic() + ASDL_TIME_LIMIT_S
    for step in range(int(plan.max_epochs * steps_per_epoch)):
        if time.monotonic() > deadline:
            break
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0:
            order = epoch_order(plan.seed, epoch, len(x_train))
        batch = torch.from_numpy(order[index * plan.global_batch : (index + 1) * plan.global_batch])
        x, y = x_train[batch], y_train[batch]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        dummy_y = gradmaker.setup_model_call(model, x)
        gradmaker.setup_loss_call(F.cross_entropy, dummy_y, y)
        gradmaker.forward_and_backward()
        optimizer.step()
        wall += time.perf_counter() - start
        if (step + 1) % plan.eval_every == 0:
            with torch.no_grad():
                model.eval()
                x_test, y_test = data["test"]
                acc = float((model(x_test).argmax(1) == y_test).float().mean())
                model.train()
            if acc >= plan.target:
                reached = {"epochs": (step + 1) / steps_per_epoch, "wall_s": wall}
                break
    return {
        "method": "asdl-kfac (1 process)",
        "lr": lr,
        "damping": ASDL_DAMPING,
        "status": "ok" if reached else f"target not reached in {step + 1} steps (cap or time limit)",
        "epochs_to_target": reached["epochs"] if reached else None,
        "wall_s_to_target": reached["wall_s"] if reached else None,
        "final_test_acc": acc,
    }


# ---------------------------------------------------------------------------------------------------------
# The benchmark.


def _plot(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {"sgd": "tab:blue", "lars": "tab:orange", "nesterov": "tab:orange", "kfac": "tab:green"}
    # Left: the whole run; right: zoomed on the target.
    for ax, bottom in zip(axes, (0.0, max(0.0, target - 0.05))):
        seen: set[str] = set()
        for run in runs:
            if not run["curve"]:
                continue
            label = None if run["method"] in seen else f"{run['method']} (lr {run['lr']:g})"
            seen.add(run["method"])
            ax.plot(
                [p["wall_s"] for p in run["curve"]],
                [p["acc"] for p in run["curve"]],
                marker=".",
                color=colors.get(run["method"]),
                alpha=0.8,
                label=label,
            )
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
        ax.set_xlabel("training wall time on 2 CPU ranks (s, evaluation excluded)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(bottom, 1.0)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    batch = runs[0]["batch"] if runs else GLOBAL_BATCH
    fig.suptitle(f"MNIST, SmallCNN (width 16), global batch {batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Run the benchmark (``quick``: a subset, a lower target, one learning rate) and write the record."""
    plan = QUICK_PLAN if quick else FULL_PLAN
    second, second_note = second_method()
    data_path = locate_mnist()
    if data_path is None:
        summary = {"kfac_time_to_target_vs_sgd": goal(None, "<= 0.75")}
        rows = [{"method": "all", "status": "skipped: mnist.npz not found (set KAISOKU_MNIST)"}]
        print_table("kfac", rows, summary)
        return write_result("kfac", out_dir, summary, rows, quick=quick, notes="MNIST archive not found")
    started = time.perf_counter()
    # Full: 40 minutes for the ranks, at most ASDL_TIME_LIMIT_S for the single-process peer.
    record = _run_ranks(plan, data_path, timeout_s=45.0 if quick else 40 * 60.0)
    runs: list[dict[str, Any]] = record["runs"]
    for item in runs:
        item["batch"] = plan.global_batch

    rows: list[dict[str, Any]] = []
    walls: dict[str, tuple[float, bool]] = {}
    for method in ["sgd", second, "kfac"]:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            rows.append({"method": method, "status": "not run: the time limit stopped the benchmark"})
            walls[method] = (math.nan, False)
            continue
        all_reached = all(r["reached"] is not None for r in mine)
        # Time to target, or the whole capped run when some repeat never got there (a lower bound).
        times = [(r["reached"] or r["curve"][-1])["wall_s"] for r in mine]
        epochs = [(r["reached"] or r["curve"][-1])["epochs"] for r in mine]
        wall, iqr = median_iqr(times)
        walls[method] = (wall, all_reached)
        split = {
            key: float(np.median([r["step_split_ms"].get(key, 0.0) for r in mine]))
            for key in mine[0]["step_split_ms"]
        }
        rows.append(
            {
                "method": method,
                "lr": record["best"][method],
                "reached_target": all_reached,
                "epochs_to_target": float(np.median(epochs)) if all_reached else None,
                "wall_s_to_target": wall if all_reached else None,
                "wall_s_run": wall,
                "wall_iqr_s": iqr,
                "repeats": len(mine),
                "final_test_acc": float(np.median([r["final_acc"] for r in mine])),
                **{f"{key}_ms_per_step": round(value, 2) for key, value in split.items()},
            }
        )
    rows.append(_asdl_row(plan, data_path, record["best"]["kfac"], quick))
    ratio = None
    ratio_note = "K-FAC did not reach the target within the cap: no ratio"
    kfac_wall, kfac_reached = walls["kfac"]
    sgd_wall, sgd_reached = walls["sgd"]
    if kfac_reached and sgd_reached:
        ratio = kfac_wall / sgd_wall
        ratio_note = "ratio of median wall times to target"
    elif kfac_reached and math.isfinite(sgd_wall):
        ratio = kfac_wall / sgd_wall
        ratio_note = (
            "upper bound: SGD did not reach the target within the cap, its whole run is the denominator"
        )
    summary = {"kfac_time_to_target_vs_sgd": goal(ratio, "<= 0.75")}
    plot_path = out_dir / "kfac.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(runs, plan.target, plot_path)
    kfac_loads = next((r["loads"] for r in runs if r["loads"]), None)
    notes = (
        f"target {plan.target:.0%} test accuracy; global batch {plan.global_batch} on {WORLD_SIZE} gloo CPU ranks "
        f"(1 thread each, DDP); lr grid {list(plan.lr_grid)} shared by every method, picked on x_val after "
        f"{plan.grid_steps} steps; {second_note}; warmup {plan.warmup_steps} steps then constant lr; wall time "
        "excludes evaluation; forward_backward includes DDP's gradient all-reduce; K-FAC communication is the "
        f"factor all-reduce and decomposition broadcast. kfac_time_to_target_vs_sgd: {ratio_note}."
    )
    if not record.get("complete", True):
        notes = (
            "INCOMPLETE: the time limit stopped the ranks; the rows hold the runs finished before. " + notes
        )
    if quick:
        notes = (
            f"QUICK: {plan.train_limit} training samples, global batch {plan.global_batch}, one lr, target "
            f"{plan.target:.0%} on {plan.eval_limit} test samples; no claim about the 98% goal. " + notes
        )
    extra = {
        "plan": asdict(plan),
        "grid": record["grid"],
        "curves": [
            {"method": r["method"], "repeat": r["repeat"], "lr": r["lr"], "curve": r["curve"]} for r in runs
        ],
        "kfac_rank_loads": kfac_loads,
        "plot": plot_path.name,
        "bench_seconds": round(time.perf_counter() - started, 1),
    }
    print_table("kfac", rows, summary)
    return write_result("kfac", out_dir, summary, rows, quick=quick, notes=notes, extra=extra)
