"""The runs of ``kaisoku bench kfac``: its plans, each method's engine config, the tuning and the timed races.

Every run is a :class:`~kaisoku.config.Config` trained by :func:`~kaisoku.engine.build.build_trainer` (the
engine ``kaisoku train`` runs), driven in chunks by :class:`~kaisoku_bench.training.EngineRun` and
validated between chunks. The procedure (:func:`procedure`, the same for every case and every method):

1. The target is the plan's stated accuracy (:attr:`Plan.target`), fixed before any run.
2. Each method tunes its step size (SGD and LARS: the learning rate; K-FAC: kl_clip) and its cosine's
   horizon (:attr:`Plan.horizons`, in epochs) with :func:`~kaisoku_bench.training.tune_pair`: the same
   grids' sizes, extension limit and run cap for every method. A grid run races to the target on the
   validation split and scores minus its epochs to it (:func:`race_score`): runs separate where it matters.
3. Per seed the tuned methods race to the target on the test split, interleaved chunk by chunk
   (:func:`race`): each round every method still running trains ``eval_every`` steps in turn (the first
   method rotating with the seed), so that all see the same machine load.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from kaisoku.config import Config
from kaisoku.data.datagen import CLASSES, draw_sample, sample_rng
from kaisoku.distributed.env import World
from kaisoku.distributed.spawn import run_ranks
from kaisoku.parts import UserParts
from kaisoku_bench.common import fast_bf16
from kaisoku_bench.training import EngineRun, bench_config, crossing, learned, npz_splits, tune_pair

WORLD_SIZE = 2
GLOBAL_BATCH = 2048
#: The methods compared, in the order of the first seed's race (the order rotates with the seed).
METHODS = ("sgd", "lars", "kfac")
#: The score of a grid run that diverged (below every run that learned, whatever its accuracy).
FAILED_SCORE = -1000.0


def _log_grid(centre: float, ratio: float, points: int = 3) -> tuple[float, ...]:
    """``points`` values spaced by ``ratio`` around ``centre`` (12 significant digits: 2 * 2**0.5 * 2**0.5
    is 4 epochs, not 96.00000000000003 steps' worth that a schedule would round up to 97)."""
    return tuple(float(f"{centre * ratio ** (k - points // 2):.12g}") for k in range(points))


@dataclass(frozen=True)
class Plan:
    """What one invocation measures."""

    lr_grid: tuple[float, ...]
    """Learning rates SGD (and LARS, without ``lars_grid``) is tuned over (extended while the best is at an
    edge)."""
    horizons: tuple[float, ...]
    """Lengths of the cosine schedule in epochs every method is tuned over (extended likewise)."""
    max_epochs: float
    """Cap of every run, grid or race: a run stops at the target, at its schedule's end or here."""
    eval_every: int
    repeats: int
    target: float
    """The stated accuracy every method races to (validation in the grids, test in the races)."""
    global_batch: int = GLOBAL_BATCH
    train_limit: int | None = None
    eval_limit: int | None = None
    val_limit: int | None = None
    """Validation images the grid runs race on (the first of the split; None: ``eval_limit``)."""
    warmup_steps: int = 4
    seed: int = 0
    kfac_options: dict[str, Any] = field(default_factory=dict)
    """``optim.kfac.*`` settings of the K-FAC runs."""
    kfac_grid: tuple[float, ...] = (3e-4, 1e-3, 3e-3)
    """K-FAC's kl_clip values (its step size under KL clipping): as many points as the others' lr grid."""
    kfac_lr: float = 0.2
    lars_grid: tuple[float, ...] = ()
    """LARS's learning rates, where they differ from ``lr_grid`` (its trust ratio rescales each layer's
    step, so its best sits elsewhere); empty: ``lr_grid``."""
    extend_limit: int = 2
    """Points added beyond an edge of a grid whose best point sits on that edge, at most (per grid)."""
    case: str = "mnist"
    """mnist (small-cnn on MNIST) or resnet10-shapes (resnet10 on the generated shapes set)."""
    world_size: int = WORLD_SIZE
    device: str = "cpu"
    """cpu (gloo ranks) or cuda (NCCL, one GPU per rank)."""

    @property
    def tuned(self) -> bool:
        """Whether the methods are tuned (a plan with one point per grid runs its settings as they are)."""
        return any(len(self.grid(method)) > 1 for method in ("sgd", "lars", "kfac")) or len(self.horizons) > 1

    def grid(self, method: str) -> tuple[float, ...]:
        """The step sizes ``method`` is tuned over: kl_clip for K-FAC, the learning rate otherwise."""
        if method == "kfac":
            return self.kfac_grid
        return self.lars_grid if method == "lars" and self.lars_grid else self.lr_grid


FULL_PLAN = Plan(
    lr_grid=(0.1, 0.2, 0.4),
    # 2, 2.83 and 4 epochs (extended down to 1.41, up to 5.66, cut at the cap): at lr 0.2 and seed 0,
    # SGD's 2-epoch cosine ended near 93.5% on x_val, its 2.83-epoch one near 95.7%.
    horizons=_log_grid(2 * 2**0.5, 2**0.5),
    max_epochs=4,
    eval_every=6,
    repeats=3,
    # Stated before any run, a round figure every method can reach within the middle horizon: in every
    # seed of an earlier record each method's test accuracy passed 95% within 2.75 epochs (SGD's and
    # LARS's 4-epoch cosines plateaued near 97%, so a target nearer the plateau would time its noise).
    target=0.95,
    # Half of x_val: an evaluation costs about 1.7 training steps, and the grids evaluate every 6.
    val_limit=5000,
    # On SGD's grid LARS was still on the top edge after 4 extensions (lr 0.8 to 6.4 within 0.09 epochs to
    # the target, 0.1 and 0.2 never reaching it): its own grid starts at 1.6.
    lars_grid=(1.6, 3.2, 6.4),
    extend_limit=4,
    kfac_options={
        "factor_update_steps": 3,
        "inv_update_steps": 6,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "bn": "unit",
        "stat_fraction": 0.25,
        # K-FAC's fastest factor arithmetic on this machine: bf16 products where bf16 is native.
        "factor_dtype": "bfloat16" if fast_bf16(torch.device("cpu")) else "float32",
    },
)


def quick_plan(plan: Plan, **changes: Any) -> Plan:
    """``plan`` for ``--quick``: one setting per method (no grid, no extension), one seed; ``changes``
    shrink the run further."""
    middle = {
        "lr_grid": (plan.lr_grid[len(plan.lr_grid) // 2],),
        "lars_grid": (plan.grid("lars")[len(plan.grid("lars")) // 2],),
        "kfac_grid": (plan.kfac_grid[len(plan.kfac_grid) // 2],),
        "horizons": (plan.horizons[len(plan.horizons) // 2],),
    }
    return replace(plan, **{**middle, "repeats": 1, "extend_limit": 0, **changes})


QUICK_PLAN = quick_plan(
    FULL_PLAN,
    horizons=(1.5,),
    max_epochs=1.5,
    eval_every=3,
    # Every method passes it within the 12 steps (so --quick runs the time figures' path too).
    target=0.45,
    global_batch=256,
    train_limit=2048,
    eval_limit=500,
    val_limit=None,
    warmup_steps=2,
)

#: Pixels per side of the resnet10 case's shapes images.
SHAPES_SIZE = 16
#: Images per split of the resnet10 case.
SHAPES_COUNTS = {"train": 16384, "val": 2048, "test": 2048}

RESNET_PLAN = Plan(
    case="resnet10-shapes",
    # Linear scaling of kaisoku train's 0.2 at batch 128 gives 1.6 at 1,024: the grid brackets it.
    lr_grid=(0.4, 0.8, 1.6),
    # 10, 14.1 and 20 epochs (extended to 7.07 or 28.3): after two every learning rate was at chance.
    horizons=_log_grid(10 * 2**0.5, 2**0.5),
    max_epochs=30,
    eval_every=8,
    repeats=3,
    target=0.9,
    global_batch=1024,
    warmup_steps=16,
    kfac_options={
        "factor_update_steps": 4,
        "inv_update_steps": 16,
        "damping": 3e-3,
        "factor_decay": 0.95,
        "bn": "unit",
        "stat_fraction": 0.25,
        "overhead_target": 0.25,
    },
    extend_limit=4,  # LARS's best was still on the grid's top edge after two extensions
    world_size=1,
    device="cuda",
)

#: The resnet10 case in --quick: 4 steps on 8 px images on the CPU (it checks the path, not the goal).
RESNET_QUICK_PLAN = quick_plan(
    RESNET_PLAN,
    horizons=(1.0,),
    max_epochs=1,
    eval_every=2,
    target=0.3,
    global_batch=64,
    warmup_steps=1,
    # Inverses, not eigendecompositions, at fixed intervals, and layer4's 4,608-wide conv left to SGD: one
    # decomposition of that factor takes about 10 s on one loaded CPU thread (the path, not the cost).
    kfac_options={
        **RESNET_PLAN.kfac_options,
        "factor_update_steps": 1,
        "inv_update_steps": 4,
        "method": "inverse",
        "overhead_target": 0.0,
        "skip_layers": ["layer4.0.conv2"],
    },
    device="cpu",
)
QUICK_SHAPES = ({"train": 256, "val": 128, "test": 128}, 8)


def second_method() -> tuple[str, str]:
    """The method compared besides SGD and K-FAC, and how it is set up: ``("lars", why)``."""
    return "lars", "LARS: eta 0.02 with LARC clipping, no adaptation on BatchNorm and biases"


def method_config(
    method: str,
    setting: float,
    horizon: float,
    plan: Plan,
    *,
    seed: int,
    train_samples: int,
    run_dir: Path,
) -> Config:
    """The config of one run: ``method`` (sgd, lars or kfac) at ``setting`` (the learning rate of SGD and
    LARS, K-FAC's kl_clip; its learning rate is ``plan.kfac_lr``), warmup then cosine over ``horizon``
    epochs, stopped at the cap (``plan.max_epochs``) at the latest."""
    cfg = bench_config(run_dir, seed=seed, device=plan.device)
    if plan.case == "resnet10-shapes":
        cfg.model.name, cfg.model.stem, cfg.model.num_classes = "resnet10", "compact", len(CLASSES)
    else:
        cfg.model.name, cfg.model.width = "small-cnn", 16
    steps_per_epoch = train_samples // plan.global_batch
    cfg.data.global_batch = plan.global_batch
    cfg.train.epochs = horizon
    # The schedule spans the horizon; the cap cuts a longer one short (it then never decays to zero).
    cfg.train.max_steps = max(1, round(plan.max_epochs * steps_per_epoch))
    cfg.train.log_every = plan.eval_every
    cfg.sched.name = "cosine"
    cfg.sched.warmup_epochs = plan.warmup_steps / steps_per_epoch
    optim = cfg.optim
    optim.name = "lars" if method == "lars" else "sgd"
    optim.lr = plan.kfac_lr if method == "kfac" else setting
    optim.momentum, optim.weight_decay = 0.9, 0.0
    if method == "lars":
        optim.eta, optim.trust_clip = 0.02, True
    if method == "kfac":
        optim.kfac.enabled = True
        for key, value in {**plan.kfac_options, "kl_clip": setting}.items():
            setattr(optim.kfac, key, value)
    return cfg


class MethodRun:
    """One method's engine run racing to ``plan.target`` on ``eval_split``, advanced a chunk at a time."""

    def __init__(
        self,
        method: str,
        setting: float,
        horizon: float,
        plan: Plan,
        data: dict[str, TensorDataset],
        world: World,
        work: Path,
        *,
        seed: int,
        eval_split: str,
    ) -> None:
        self.method, self.setting, self.horizon, self.seed = method, setting, horizon, seed
        self.target, self.eval_every, self.world = plan.target, plan.eval_every, world
        run_dir = work / f"{method}-{setting:g}-h{horizon:g}-{seed}-{eval_split}"
        cfg = method_config(
            method, setting, horizon, plan, seed=seed, train_samples=len(data["train"]), run_dir=run_dir
        )
        self.engine = EngineRun(cfg, world, UserParts(train_data=data["train"], val_data=data[eval_split]))
        self.curve: list[dict[str, float]] = []
        self.reached: dict[str, float] | None = None
        self.done = False

    def advance(self, steps: int) -> bool:
        """Train ``steps`` more steps and evaluate; False once the run is over: it reached the target,
        its schedule (or the cap) ended, or it diverged. Every rank agrees (the accuracy is all-reduced)."""
        if self.done:
            return False
        run = self.engine
        trained = run.train(steps)
        point = {
            "step": run.step,
            "epochs": run.step / run.steps_per_epoch,
            "wall_s": run.seconds,
            "acc": run.accuracy(),
        }
        previous = self.curve[-1] if self.curve else None
        self.curve.append(point)
        if trained and point["acc"] >= self.target:
            self.reached = crossing(previous, point, self.target)
        self.done = self.reached is not None or not trained or run.step >= run.total_steps
        if self.done:
            run.close()
            self._print()
        return not self.done

    def finish(self) -> dict[str, Any]:
        """Advance to the end; the result."""
        while self.advance(self.eval_every):
            pass
        return self.result()

    def _print(self) -> None:
        if self.world.rank == 0:
            knob = "kl_clip" if self.method == "kfac" else "lr"
            print(
                f"  {self.method:5s} {knob} {self.setting:<6g} horizon {self.horizon:<5g} seed {self.seed}  "
                f"steps {self.engine.step:4d}  acc {self.final_acc:.4f}  wall {self.engine.seconds:7.1f} s  "
                f"reached {'yes' if self.reached else 'no'}",
                flush=True,
            )

    @property
    def final_acc(self) -> float:
        """The last evaluated accuracy (NaN before any)."""
        return self.curve[-1]["acc"] if self.curve else float("nan")

    def result(self) -> dict[str, Any]:
        """The run's record: settings, accuracy curve, where it reached the target, the step's time split."""
        kfac = getattr(self.engine.trainer.engine, "preconditioner", None)
        return {
            "method": self.method,
            "lr": self.setting,
            "horizon": self.horizon,
            "seed": self.seed,
            "curve": self.curve,
            "reached": self.reached,
            "diverged": self.engine.diverged or not learned(self.final_acc),
            "final_acc": self.final_acc,
            "best_acc": max((p["acc"] for p in self.curve if np.isfinite(p["acc"])), default=float("nan")),
            "step_split_ms": self.engine.phase_ms_per_step(),
            "steps": self.engine.step,
            "loads": kfac.rank_loads() if kfac is not None else None,
        }


def race_score(result: dict[str, Any], target: float, cap_epochs: float) -> float:
    """A grid run's score (higher is better): minus its epochs to the target where it reached it; at or
    below :func:`unreached_score` (less its gap to the target) where it did not; :data:`FAILED_SCORE`
    where it diverged. Epochs stand for time: one method's settings change no step's cost."""
    if result["diverged"]:
        return FAILED_SCORE
    if result["reached"] is not None:
        return -float(result["reached"]["epochs"])
    return unreached_score(cap_epochs) - max(0.0, target - result["best_acc"])


def unreached_score(cap_epochs: float) -> float:
    """The highest score of a grid run that never reached the target: below every run that did (those
    score above minus the cap). It has no time to target, so for :func:`tune`'s fall-off it counts as
    failed, as a diverged run does."""
    return -cap_epochs - 1.0


def vouched_inside(
    inside: tuple[bool, bool],
    details: dict[tuple[float, float], dict[str, Any]],
    setting: float,
    horizon: float,
    middle: float,
) -> dict[str, bool]:
    """Whether the tuned step size and horizon are inside their grids: :func:`tune_pair`'s verdict, and the
    best of each pass reached the target (the step size's pass ran at the ``middle`` horizon). A best that
    never reached it won no race: its neighbours' failing to reach it too vouches for nothing."""
    reached = {
        key: details[(setting, h)]["epochs_to_target"] is not None
        for key, h in (("setting", middle), ("horizon", horizon))
    }
    return {"setting": inside[0] and reached["setting"], "horizon": inside[1] and reached["horizon"]}


def tune_method(
    method: str, plan: Plan, data: dict[str, TensorDataset], world: World, work: Path
) -> dict[str, Any]:
    """``method``'s step size and horizon by :func:`tune_pair` over grid runs of seed ``plan.seed`` racing
    to the target on the validation split; or, for a plan with one point per grid, those points."""
    settings = plan.grid(method)
    if not plan.tuned:
        return {
            "setting": settings[0],
            "horizon": plan.horizons[0],
            "inside": {"setting": False, "horizon": False},  # not tuned: no tried neighbour on a side
            "points": [],
        }
    details: dict[tuple[float, float], dict[str, Any]] = {}

    def score(setting: float, horizon: float) -> float:
        run = MethodRun(method, setting, horizon, plan, data, world, work, seed=plan.seed, eval_split="val")
        result = run.finish()
        details[(setting, horizon)] = {
            "epochs_to_target": (result["reached"] or {}).get("epochs"),
            "best_val_acc": result["best_acc"],
            "diverged": result["diverged"],
        }
        return race_score(result, plan.target, plan.max_epochs)

    (setting, horizon), points, inside = tune_pair(
        settings, plan.horizons, score, plan.extend_limit, failed_score=unreached_score(plan.max_epochs)
    )
    return {
        "setting": setting,
        "horizon": horizon,
        "inside": vouched_inside(inside, details, setting, horizon, plan.horizons[len(plan.horizons) // 2]),
        "points": [
            {"method": method, "setting": p["first"], "horizon": p["second"], "score": p["score"]}
            | details[(p["first"], p["second"])]
            for p in points
        ],
    }


def race(
    plan: Plan,
    best: dict[str, dict[str, Any]],
    data: dict[str, TensorDataset],
    world: World,
    work: Path,
    *,
    seed: int,
    order: Sequence[str],
) -> list[dict[str, Any]]:
    """Every method of ``order`` at its tuned settings, from the initial weights and data order of
    ``seed``, racing to the target on the test split: each round, every method still running trains
    ``plan.eval_every`` steps and is evaluated, in ``order``."""
    runs = [
        MethodRun(
            method,
            best[method]["setting"],
            best[method]["horizon"],
            plan,
            data,
            world,
            work,
            seed=seed,
            eval_split="test",
        )
        for method in order
    ]
    running = list(runs)
    while running:
        running = [run for run in running if run.advance(plan.eval_every)]
    return [run.result() for run in runs]


def procedure(
    rank: int, world_size: int, out: Path, plan_dict: dict[str, Any], data_path: str
) -> dict[str, Any]:
    """The benchmark on one rank (every rank runs it): tune every method, then race them per seed.

    ``plan_dict``: the :class:`Plan` as a dict; ``data_path``: the ``.npz`` of the splits; ``out``: the
    runs' folder. Returns ``{"complete", "grid", "best", "runs"}``; rank 0 saves what is done after every
    method's tuning and every seed's race (``rank0.partial.pt``), for a time limit that stops the ranks.
    """
    fields = ("lr_grid", "lars_grid", "kfac_grid", "horizons")
    plan = Plan(**{**plan_dict, **{key: tuple(plan_dict[key]) for key in fields}})
    world = World(rank=rank, world_size=world_size, local_world_size=world_size)
    val_limit = plan.eval_limit if plan.val_limit is None else plan.val_limit
    limits = {"train": plan.train_limit, "val": val_limit, "test": plan.eval_limit}
    data = npz_splits(Path(data_path), limits)
    work = out / "runs"
    state: dict[str, Any] = {"ok": True, "complete": False, "grid": [], "best": {}, "runs": []}

    def save() -> None:
        if rank == 0:  # what is done so far survives a time limit that stops the ranks
            torch.save(state, out / "rank0.partial.pt")

    # The grids score epochs to the target, never time: their order cannot favour a method.
    for method in METHODS:
        tuned = tune_method(method, plan, data, world, work)
        state["grid"] += tuned.pop("points")
        state["best"][method] = tuned
        save()
    for repeat in range(plan.repeats):
        shift = repeat % len(METHODS)
        order = METHODS[shift:] + METHODS[:shift]
        for result in race(plan, state["best"], data, world, work, seed=plan.seed + repeat, order=order):
            state["runs"].append({**result, "repeat": repeat, "target": plan.target, "order": list(order)})
        save()
    return {**state, "complete": True}


def run_on_ranks(plan: Plan, data_path: Path, timeout_s: float) -> dict[str, Any]:
    """Every run on the ranks; after a time limit, what rank 0 finished before it."""
    with tempfile.TemporaryDirectory(prefix="kaisoku-kfac-") as tmp:
        try:
            return run_ranks(
                procedure,
                plan.world_size,
                Path(tmp),
                asdict(plan),
                str(data_path),
                timeout=timeout_s,
                collective_timeout=300.0,
                backend="nccl" if plan.device == "cuda" else "gloo",
            )[0]
        except AssertionError as error:
            partial = Path(tmp) / f"ranks{plan.world_size}" / "rank0.partial.pt"
            if not partial.exists():
                raise RuntimeError(
                    f"K-FAC benchmark ranks produced no result (limit {timeout_s:.0f} s):\n{error}"
                ) from None
            return torch.load(partial, weights_only=False)


def _draw(split: str, start: int, stop: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.arange(start, stop) % len(CLASSES)
    images = [
        draw_sample(int(label), size, sample_rng(0, split, index))
        for index, label in zip(range(start, stop), labels)
    ]
    return np.stack(images).transpose(0, 3, 1, 2).copy(), labels.astype(np.int64)


def write_shapes(path: Path, counts: dict[str, int], size: int, workers: int = 8) -> Path:
    """Draw the shapes splits (images keyed by (split, index), seed 0) into ``path`` as a ``.npz`` of
    ``x_<split>`` ``(N, 3, size, size)`` uint8 and ``y_<split>``."""
    arrays: dict[str, np.ndarray] = {}
    chunk = 1024
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for split, count in counts.items():
            parts = list(
                pool.map(
                    _draw, *zip(*[(split, s, min(s + chunk, count), size) for s in range(0, count, chunk)])
                )
            )
            arrays[f"x_{split}"] = np.concatenate([x for x, _ in parts])
            arrays[f"y_{split}"] = np.concatenate([y for _, y in parts])
    np.savez(path, **arrays)
    return path
