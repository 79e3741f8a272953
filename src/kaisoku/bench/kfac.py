"""``kaisoku bench kfac``: wall time to a target MNIST test accuracy for SGD, LARS and K-FAC on 2 CPU ranks.

A small BatchNorm CNN (``SmallCNN``, width 16) is trained data-parallel (DDP, gloo, one thread per rank)
at global batch 2,048 by three methods with the same tuning budget: SGD and LARS each tune the learning
rate over a 3-point grid, K-FAC (in front of momentum SGD, factor statistics on a quarter of the batch)
tunes kl_clip, its step size, over 3 points; every grid is extended while its best point is at an edge.
Every method gets warmup then cosine decay over the cap. Per seed (initial weights and data order), SGD
trains the whole cap; the target is its best test accuracy less half a point; the other methods train
until they reach it. Time to target is interpolated between evaluations (every few steps, evaluation
time excluded); medians over the seeds count. The K-FAC step time is split into forward/backward, factor
statistics, decomposition, communication and preconditioning. ASDL (``asdl``) runs single-process on the
same model where it is installed (``kaisoku.bench.kfac_peers``).
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisoku.bench.common import fast_bf16, goal, locate_mnist, median_iqr, print_table, write_result
from kaisoku.distributed.spawn import run_ranks
from kaisoku.optim.kfac import KFAC

WORLD_SIZE = 2
GLOBAL_BATCH = 2048
TARGET_ACCURACY = 0.98


@dataclass(frozen=True)
class Plan:
    """What one invocation measures."""

    lr_grid: tuple[float, ...]
    """Learning rates SGD and LARS are tuned over (extended while the best is at an edge)."""
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
    kfac_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    """K-FAC's kl_clip values (its step size under KL clipping): as many points as the others' lr grid."""
    kfac_lr: float = 0.2
    extend_limit: int = 2
    """Points added beyond an edge of a grid whose best point sits on that edge, at most."""
    target_drop: float = 0.005
    """The target is the best test accuracy SGD reaches within the cap, minus this."""


FULL_PLAN = Plan(
    lr_grid=(0.1, 0.2, 0.4),
    grid_steps=12,
    max_epochs=4,
    eval_every=6,
    repeats=3,
    target=TARGET_ACCURACY,
    kfac_options={
        "factor_update_steps": 3,
        "inv_update_steps": 6,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "kl_clip": 1e-3,
        "bn": "unit",
        "stat_fraction": 0.25,
        # K-FAC's fastest factor arithmetic on this machine: bf16 products where bf16 is native.
        "factor_dtype": "bfloat16" if fast_bf16(torch.device("cpu")) else "float32",
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
    kfac_grid=(1e-3,),
    extend_limit=0,
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


def crossing(previous: dict[str, float] | None, point: dict[str, float], target: float) -> dict[str, float]:
    """Where the accuracy curve crosses ``target`` between two evaluations, linearly interpolated."""
    if previous is None or point["acc"] <= previous["acc"]:
        return dict(point)
    share = min(1.0, max(0.0, (target - previous["acc"]) / (point["acc"] - previous["acc"])))
    return {
        key: previous[key] + share * (point[key] - previous[key]) if key != "acc" else target for key in point
    }


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup, then cosine decay to 0 at ``total_steps``: the schedule every method gets."""
    warm = min(1.0, (step + 1) / max(1, warmup_steps))
    return warm * 0.5 * (1.0 + math.cos(math.pi * min(1.0, step / max(1, total_steps))))


#: Final accuracy at or below this counts as diverged (chance is 0.1 on ten classes).
CHANCE_CEILING = 0.2


def train_run(
    method: str,
    setting: float,
    plan: Plan,
    data: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    world: int,
    *,
    seed: int,
    max_steps: int | None,
    eval_split: str,
    stop_at: float | None,
) -> dict[str, Any]:
    """Train one method from the initial weights of ``seed``; return the accuracy curve and the time split.

    ``setting`` is the learning rate of SGD and LARS and K-FAC's kl_clip (its learning rate is
    ``plan.kfac_lr``). ``stop_at``: stop once the evaluated accuracy reaches it.
    """
    torch.manual_seed(seed)
    model = DistributedDataParallel(build_model())
    base_method = "sgd" if method == "kfac" else method
    lr = plan.kfac_lr if method == "kfac" else setting
    optimizer = _make_optimizer(base_method, model.module, lr)
    kfac = (
        KFAC(model, lr=optimizer, **{**plan.kfac_options, "kl_clip": setting}) if method == "kfac" else None
    )
    x_train, y_train = data["train"]
    per_rank = plan.global_batch // world
    steps_per_epoch = len(x_train) // plan.global_batch
    cap_steps = total_steps = int(plan.max_epochs * steps_per_epoch)
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
            order = epoch_order(seed, epoch, len(x_train))
        batch = order[index * plan.global_batch : (index + 1) * plan.global_batch]
        mine = torch.from_numpy(batch[rank * per_rank : (rank + 1) * per_rank])
        x, y = x_train[mine], y_train[mine]
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, plan.warmup_steps, cap_steps)
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
            previous = curve[-1] if curve else None
            curve.append(point)
            if reached is None and stop_at is not None and accuracy >= stop_at:
                reached = crossing(previous, point, stop_at)
                break
    if rank == 0:
        print(
            f"  {method:9s} {'kl_clip' if kfac else 'lr'} {setting:<6g} steps {step + 1:4d}  acc {curve[-1]['acc'] if curve else float('nan'):.4f}"
            f"  wall {wall:7.1f} s  reached {'yes' if reached else ('-' if stop_at is None else 'no')}",
            flush=True,
        )
    if kfac is not None:
        # The statistics hooks ran inside forward/backward and were taken out of it above; "factor" is
        # the hooks plus the running averages.
        timings = kfac.timings
        for phase in ("factor", "decomposition", "communication", "precondition"):
            split_seconds[phase] = timings.get(phase, 0.0)
    steps_run = max(1, curve[-1]["step"] if curve else 1)
    final = curve[-1]["acc"] if curve else float("nan")
    return {
        "method": method,
        "lr": setting,
        "seed": seed,
        "curve": curve,
        "reached": reached,
        "diverged": diverged or not final > CHANCE_CEILING,
        "final_acc": curve[-1]["acc"] if curve else float("nan"),
        "step_split_ms": {k: 1000.0 * v / steps_run for k, v in split_seconds.items()},
        "steps": steps_run,
        "loads": kfac.rank_loads() if kfac else None,
    }


def first_crossing(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The interpolated point where ``curve`` first reaches ``target``, or None."""
    previous = None
    for point in curve:
        if point["acc"] >= target:
            return crossing(previous, point, target)
        previous = point
    return None


def tune(grid: tuple[float, ...], score: Any, extend_limit: int) -> tuple[float, list[dict[str, Any]], bool]:
    """The best setting of a log-spaced ``grid`` by ``score(setting)`` (higher is better).

    While the best point is at an edge, one more point is added beyond it at the grid's ratio, up to
    ``extend_limit`` times. Returns the best setting, every point tried, and whether the best is inside.
    """
    scores = {value: score(value) for value in grid}
    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0
    for _ in range(extend_limit if len(grid) > 1 else 0):
        values = sorted(scores)
        best = max(values, key=scores.__getitem__)
        if best == values[0]:
            scores[values[0] / ratio] = score(values[0] / ratio)
        elif best == values[-1]:
            scores[values[-1] * ratio] = score(values[-1] * ratio)
        else:
            break
    values = sorted(scores)
    best = max(values, key=scores.__getitem__)
    inside = len(values) == 1 or values[0] < best < values[-1]
    return best, [{"setting": v, "val_acc": scores[v]} for v in values], inside


def _worker(
    rank: int, world_size: int, out: Path, plan_dict: dict[str, Any], data_path: str
) -> dict[str, Any]:
    fields = ("lr_grid", "kfac_grid")
    plan = Plan(**{**plan_dict, **{key: tuple(plan_dict[key]) for key in fields}})
    data = _load(Path(data_path), plan)
    # K-FAC right after SGD, so that a time limit cuts the peer rather than the compared pair.
    methods = ["sgd", "kfac", second_method()[0]]
    grid: list[dict[str, Any]] = []
    best: dict[str, float] = {}
    inside: dict[str, bool] = {}
    for method in methods:
        settings = plan.kfac_grid if method == "kfac" else plan.lr_grid
        if plan.grid_steps > 0 and len(settings) > 1:

            def score(value: float, method: str = method) -> float:
                run = train_run(
                    method, value, plan, data, rank, WORLD_SIZE,
                    seed=plan.seed, max_steps=plan.grid_steps, eval_split="val", stop_at=None,
                )  # fmt: skip
                return -1.0 if run["diverged"] else run["final_acc"]

            best[method], points, inside[method] = tune(settings, score, plan.extend_limit)
            grid += [{"method": method, **point} for point in points]
        else:
            best[method] = settings[len(settings) // 2]
            inside[method] = len(settings) == 1
    runs: list[dict[str, Any]] = []
    for repeat in range(plan.repeats):
        seed = plan.seed + repeat
        # SGD runs its whole cap; the target of this seed is its best accuracy less target_drop.
        sgd = train_run(
            "sgd", best["sgd"], plan, data, rank, WORLD_SIZE,
            seed=seed, max_steps=None, eval_split="test", stop_at=None,
        )  # fmt: skip
        target = max((p["acc"] for p in sgd["curve"]), default=plan.target) - plan.target_drop
        sgd["reached"] = first_crossing(sgd["curve"], target)
        shift = repeat % (len(methods) - 1)
        others = methods[1:]
        batch_runs = [sgd]
        for method in others[shift:] + others[:shift]:
            batch_runs.append(
                train_run(
                    method,
                    best[method],
                    plan,
                    data,
                    rank,
                    WORLD_SIZE,
                    seed=seed,
                    max_steps=None,
                    eval_split="test",
                    stop_at=target,
                )  # fmt: skip
            )
        for run in batch_runs:
            run.update(repeat=repeat, target=target)
            runs.append(run)
        if rank == 0:
            # What is done so far survives a time limit that stops the ranks.
            partial = Path(out) / "rank0.partial.pt"
            state = {
                "ok": True,
                "complete": False,
                "grid": grid,
                "best": best,
                "inside": inside,
                "runs": runs,
            }
            torch.save(state, partial)
    return {"ok": True, "complete": True, "grid": grid, "best": best, "inside": inside, "runs": runs}


def _run_ranks(plan: Plan, data_path: Path, timeout_s: float) -> dict[str, Any]:
    """Every run on the gloo ranks; after a time limit, what rank 0 finished before it."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-kfac-") as tmp:
        try:
            return run_ranks(
                _worker,
                WORLD_SIZE,
                Path(tmp),
                asdict(plan),
                str(data_path),
                timeout=timeout_s,
                collective_timeout=300.0,
            )[0]
        except AssertionError as error:
            partial = Path(tmp) / f"ranks{WORLD_SIZE}" / "rank0.partial.pt"
            if not partial.exists():
                raise RuntimeError(
                    f"K-FAC benchmark ranks produced no result (limit {timeout_s:.0f} s):\n{error}"
                ) from None
            return torch.load(partial, weights_only=False)


# ---------------------------------------------------------------------------------------------------------
# The benchmark.


#: Summary goal -> target. Every one is always recorded (null with a reason where not measured).
GOALS = {
    "kfac_time_to_target_vs_best_mnist": "<= 0.75",
    "kfac_time_to_target_vs_best_resnet10_shapes": "<= 0.75",
    "kfac_time_to_target_vs_sgd": "<= 0.75",
    "kfac_step_time_vs_sgd": "<= 1.3",
}


def _summary(
    walls: dict[str, tuple[float, bool]], rows: list[dict[str, Any]], second: str
) -> dict[str, dict[str, Any]]:
    """The goals from the median times to target (``walls``) and the amortised step times of ``rows``."""
    kfac_wall, kfac_reached = walls["kfac"]
    peers = {name: walls[name] for name in ("sgd", second) if name in walls}
    reached_peers = {name: wall for name, (wall, ok) in peers.items() if ok and math.isfinite(wall)}
    best_peer = min(reached_peers, key=reached_peers.__getitem__) if reached_peers else None
    not_reached = "K-FAC did not reach the target in every seed within the cap"
    vs_best = kfac_wall / reached_peers[best_peer] if kfac_reached and best_peer else None
    sgd_wall, sgd_ok = walls.get("sgd", (math.nan, False))
    vs_sgd = kfac_wall / sgd_wall if kfac_reached and sgd_ok else None
    steps = {row["method"]: row.get("step_ms") for row in rows}
    step_ratio = steps["kfac"] / steps["sgd"] if steps.get("kfac") and steps.get("sgd") else None
    return {
        "kfac_time_to_target_vs_best_mnist": goal(
            vs_best,
            GOALS["kfac_time_to_target_vs_best_mnist"],
            reason="" if vs_best is not None else (not_reached if not kfac_reached else "no peer reached it"),
            best_peer=best_peer,
        ),
        "kfac_time_to_target_vs_best_resnet10_shapes": goal(
            None,
            GOALS["kfac_time_to_target_vs_best_resnet10_shapes"],
            reason="resnet10 on the generated shapes set at batch 1,024 is not part of this benchmark yet",
        ),
        "kfac_time_to_target_vs_sgd": goal(
            vs_sgd, GOALS["kfac_time_to_target_vs_sgd"], reason="" if vs_sgd is not None else not_reached
        ),
        "kfac_step_time_vs_sgd": goal(
            step_ratio,
            GOALS["kfac_step_time_vs_sgd"],
            reason="" if step_ratio is not None else "a method's step time was not measured",
        ),
    }


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Run the benchmark (``quick``: a subset, a lower target, one learning rate) and write the record."""
    plan = QUICK_PLAN if quick else FULL_PLAN
    second, second_note = second_method()
    data_path = locate_mnist()
    if data_path is None:
        reason = "MNIST archive not found: pass --mnist PATH or set KAISOKU_MNIST"
        summary = {name: goal(None, target, reason=reason) for name, target in GOALS.items()}
        rows = [{"method": "all", "status": f"skipped: {reason}"}]
        print_table("kfac", rows, summary)
        return write_result("kfac", out_dir, summary, rows, quick=quick, notes="MNIST archive not found")
    from kaisoku.bench.kfac_peers import asdl_row, plot_curves

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
                "setting": f"{'kl_clip' if method == 'kfac' else 'lr'} {record['best'][method]:g}",
                "grid_best_inside": record.get("inside", {}).get(method),
                "diverged_repeats": sum(bool(r["diverged"]) for r in mine),
                "step_ms": round(sum(split.values()), 2),
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
    targets = [r["target"] for r in runs if "target" in r]
    rows.append(asdl_row(plan, data_path, plan.kfac_lr, quick, targets[0] if targets else plan.target))
    summary = _summary(walls, rows, second)
    plot_path = out_dir / "kfac.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_curves(runs, plot_path)
    kfac_loads = next((r["loads"] for r in runs if r["loads"]), None)
    notes = (
        f"target per seed: SGD's best test accuracy within the cap less {plan.target_drop} (median "
        f"{float(np.median(targets)) if targets else plan.target:.4f}); global batch {plan.global_batch} on "
        f"{WORLD_SIZE} gloo CPU ranks "
        f"(1 thread each, DDP); SGD and LARS tune lr over {list(plan.lr_grid)}, K-FAC (lr {plan.kfac_lr}, "
        f"factors in {plan.kfac_options.get('factor_dtype', 'float32')}) "
        f"tunes kl_clip over {list(plan.kfac_grid)}: the same number of points, each grid extended up to "
        f"{plan.extend_limit} times while its best is at an edge, picked on x_val after {plan.grid_steps} "
        f"steps; a run ending at <= {CHANCE_CEILING} accuracy counts as diverged; {second_note}; every "
        f"method: {plan.warmup_steps} warmup steps then cosine decay over the {plan.max_epochs}-epoch cap; "
        f"per seed ({plan.repeats} seeds: init and order), the target is SGD's best test accuracy within "
        f"the cap minus {plan.target_drop}; the others run until they reach it; time to target is "
        "interpolated between evaluations, evaluation excluded; forward_backward includes DDP's gradient "
        "all-reduce; K-FAC communication is the factor all-reduce and decomposition broadcast."
    )
    if not record.get("complete", True):
        notes = (
            "INCOMPLETE: the time limit stopped the ranks; the rows hold the runs finished before. " + notes
        )
    if quick:
        notes = (
            f"QUICK: {plan.train_limit} training samples, global batch {plan.global_batch}, one setting per "
            f"method, {plan.eval_limit} test samples; no claim about the goals. " + notes
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
