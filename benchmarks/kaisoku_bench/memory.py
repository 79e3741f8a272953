"""``kaisoku bench memory``: peak memory, step time and exactness of each memory technique against plain.

Every row is one (model, technique) built with the objects ``kaisoku train`` builds (``build_model``,
:func:`~kaisoku.memory.profile.setup_memory`, ``build_optimizer``, ``build_scheduler``,
:func:`~kaisoku.memory.in_backward.attach_update_in_backward`, :class:`~kaisoku.engine.step.DataParallelStep`)
on synthetic batches keyed by step index; peaks in their own subprocess
(:func:`kaisoku.memory.measure.measure_in_subprocess`), step times interleaved, exactness bit for bit against
plain. Planner, compression and largest-batch rows: ``benchmarks/README.md``, section memory.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisoku.config import Config, OptimConfig, SchedConfig
from kaisoku.config_sections import MemoryConfig
from kaisoku.distributed.env import World
from kaisoku.engine.build import build_trainer
from kaisoku.engine.compile import synthetic_batch
from kaisoku.engine.step import DataParallelStep, Precision
from kaisoku.errors import KaisokuError
from kaisoku.memory.in_backward import attach_update_in_backward
from kaisoku.memory.measure import measure_in_subprocess
from kaisoku.memory.profile import setup_memory
from kaisoku.models.zoo import build_model
from kaisoku.optim.factory import build_optimizer, build_scheduler
from kaisoku.run_facts import check_config
from kaisoku_bench.common import bench_device, goal, interleaved, locate_mnist, median_iqr, record_and_show
from kaisoku_bench.goals import worst_goal
from kaisoku_bench.parallel_mnist import packed_mnist

#: Technique -> its ``memory.*`` settings (offload_dir is filled in at run time).
TECHNIQUES: dict[str, dict[str, Any]] = {
    "plain": {},
    "recompute-blocks": {"recompute": "blocks"},
    "recompute-selective": {"recompute": "selective"},
    "update-in-backward": {"update_in_backward": True},
    "blocks+in-backward": {"recompute": "blocks", "update_in_backward": True},
    "compress-bf16": {"compress": "bf16"},
    "compress-int8": {"compress": "int8"},
    "offload-disk": {"offload": "disk"},
}
#: Techniques that must train bit-identically to plain.
EXACT = (
    "recompute-blocks",
    "recompute-selective",
    "update-in-backward",
    "blocks+in-backward",
    "offload-disk",
)

#: Planner rows: name -> budget as a fraction of plain's rise.
PLANNER = {"planner-60%": 0.6, "planner-40%": 0.4}
MIB = float(1 << 20)
#: The largest-batch search looks up to this multiple of the reference batch.
CEILING = 3
MODELS = {"resnet18": "resnet18", "vit": "vit-tiny"}


@dataclass(frozen=True)
class Sizes:
    """The run's sizes: full or --quick."""

    image: dict[str, int]
    batch: dict[str, int]
    repeats: int
    unit: int
    probes: int
    techniques: dict[str, tuple[str, ...]]
    accuracy: dict[str, int]
    planner: dict[str, tuple[str, ...]]
    accuracy_modes: tuple[str, ...] = ("none", "bf16", "int8")


FULL = Sizes(
    image={"resnet18": 64, "vit": 32},
    batch={"resnet18": 128, "vit": 64},
    repeats=3,
    unit=16,
    probes=3,
    techniques={
        # int8: in the accuracy run and the planner's choices; blocks+in-backward: in --quick
        "resnet18": tuple(t for t in TECHNIQUES if t not in ("compress-int8", "blocks+in-backward")),
        "vit": ("plain", "recompute-blocks", "update-in-backward", "compress-bf16", "offload-disk"),
    },
    accuracy={"count": 9600, "val_count": 5000, "batch": 64, "epochs": 2, "seeds": 3},
    planner={"resnet18": tuple(PLANNER), "vit": tuple(PLANNER)},
)
QUICK = Sizes(
    image={"resnet18": 16, "vit": 16},
    batch={"resnet18": 4, "vit": 8},
    repeats=3,
    unit=8,
    probes=0,
    techniques={"resnet18": ("plain", "blocks+in-backward"), "vit": ("plain", "offload-disk")},
    accuracy={"count": 64, "val_count": 32, "batch": 16, "epochs": 1, "seeds": 2},
    planner={"vit": ("planner-60%",)},
    accuracy_modes=("none", "bf16"),
)


def _model(name: str, image: int) -> nn.Module:
    net = build_model(MODELS[name], num_classes=10, size=image)
    if name == "vit":  # torchvision zeroes the head: give the body a gradient from the first step
        head = net.heads.head  # type: ignore[union-attr]
        nn.init.normal_(head.weight, std=0.02)
    return net


class Setup:
    """One (model, memory settings) as ``kaisoku train`` builds it, with batches keyed by step index."""

    def __init__(self, model: str, memory: dict[str, Any], *, batch: int, image: int, seed: int = 0) -> None:
        self.device = bench_device()
        torch.manual_seed(seed)
        net = _model(model, image).to(self.device)
        settings = MemoryConfig(**memory)
        self.memory = setup_memory(
            net,
            settings,
            device=self.device,
            example=lambda: synthetic_batch((batch, 3, image, image), 10, self.device, seed=0),
        )
        torch.manual_seed(seed + 1)  # the same state after setup whether or not the planner profiled
        optimizer = build_optimizer(net, OptimConfig(name="sgd", lr=0.05, momentum=0.9))
        if settings.update_in_backward:
            attach_update_in_backward(net, optimizer)
        scheduler = build_scheduler(optimizer, SchedConfig(), steps_per_epoch=100, total_steps=1000)
        self.engine = DataParallelStep(
            net,
            optimizer,
            scheduler,  # type: ignore[arg-type]
            loss_fn=nn.CrossEntropyLoss(),
            precision=Precision("fp32", self.device),
            update_in_backward=settings.update_in_backward,
            activations=self.memory.activations,
        )
        self.batch, self.image, self.seed, self.index = batch, image, seed, 0
        self.losses: list[float] = []

    def data(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of step ``index`` (the same for every technique)."""
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        images = torch.randn(self.batch, 3, self.image, self.image, generator=gen)
        labels = torch.randint(0, 10, (self.batch,), generator=gen)
        return images.to(self.device), labels.to(self.device)

    def step(self) -> dict[str, Any]:
        """One training step on the next batch; its loss and the memory plan (if any)."""
        loss = self.engine.train_step([self.data(self.index)])
        self.index += 1
        self.losses.append(float(loss))
        plan = self.memory.plan
        return {"loss": float(loss), "plan": plan.summary() if plan else ""}

    def close(self) -> None:
        """Release the offload store, if any."""
        if self.memory.offload is not None:
            self.memory.offload.close()


def build_step(**kwargs: Any) -> tuple[Callable[[], dict[str, Any]], torch.device]:
    """The measured step of one configuration (called in the measuring subprocess)."""
    setup = Setup(**kwargs)
    return setup.step, setup.device


def _timed(setup: Setup) -> Callable[[], float]:
    def once() -> float:
        start = time.perf_counter()
        setup.step()
        if setup.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return once


def _peak(model: str, memory: dict[str, Any], batch: int, image: int) -> dict[str, Any]:
    """Peak and rise of one step in MiB (own subprocess), and the plan it ran."""
    kwargs = {"model": model, "memory": memory, "batch": batch, "image": image}
    reading = measure_in_subprocess("kaisoku_bench.memory:build_step", kwargs, timeout=900)
    return {
        "peak": reading.peak_bytes / MIB,
        "rise": (reading.peak_bytes - reading.before_bytes) / MIB,
        "plan": reading.extra.get("plan", ""),
    }


def measure_model(model: str, sizes: Sizes, offload_dir: str) -> list[dict[str, Any]]:
    """Every technique and both planner budgets on ``model``: peak, rise, step time, exactness."""
    batch, image = sizes.batch[model], sizes.image[model]
    memory = {t: dict(TECHNIQUES[t]) for t in sizes.techniques[model]}
    for settings in memory.values():
        if settings.get("offload") == "disk":
            settings["offload_dir"] = offload_dir
    peaks = {t: _peak(model, m, batch, image) for t, m in memory.items()}
    budgets: dict[str, int] = {}
    refused: dict[str, str] = {}
    for name in sizes.planner.get(model, ()):
        budgets[name] = int(PLANNER[name] * peaks["plain"]["rise"] * MIB)
        # The planner with the update in backward: gradients are a third of a resnet18 step's rise at
        # these sizes, and no per-block technique touches them.
        settings = {"budget": f"{budgets[name]}B", "offload_dir": offload_dir, "update_in_backward": True}
        try:
            peaks[name] = _peak(model, settings, batch, image)
            # The timed run applies the plan the measured one chose (a policy naming every block).
            memory[name] = {
                "policy": peaks[name]["plan"],
                "offload_dir": offload_dir,
                "update_in_backward": True,
            }
        except KaisokuError as exc:  # the planner's one line: nothing fits this budget
            refused[name] = str(exc).rsplit("ConfigError: ", 1)[-1]
    # Every setup starts from the same weights and runs the same batches in the same order (its own
    # step index), so the timed steps double as the exactness run: warm-up + repeats steps each.
    setups = {t: Setup(model, m, batch=batch, image=image) for t, m in memory.items()}
    for setup in setups.values():
        setup.step()  # warm-up outside the timing
    times = interleaved({t: _timed(s) for t, s in setups.items()}, sizes.repeats)
    finals = {
        t: (s.losses, {k: v.detach().cpu() for k, v in s.engine.model.state_dict().items()})
        for t, s in setups.items()
    }
    for setup in setups.values():
        setup.close()
    del setups
    plain_losses, plain_state = finals["plain"]
    plain_time = median_iqr(times["plain"])[0]
    plain_rise = peaks["plain"]["rise"]
    rows = []
    for technique in memory:
        losses, state = finals[technique]
        median, iqr = median_iqr(times[technique])
        exact = losses == plain_losses and all(torch.equal(state[k], plain_state[k]) for k in plain_state)
        budget = budgets.get(technique)
        rows.append(
            {
                "model": model,
                "technique": technique,
                "batch": batch,
                "peak_mib": round(peaks[technique]["peak"], 1),
                "rise_mib": round(peaks[technique]["rise"], 1),
                "rise_vs_plain": round(peaks[technique]["rise"] / plain_rise, 3),
                "budget_mib": round(budget / MIB, 1) if budget else None,
                "within_budget": peaks[technique]["rise"] * MIB <= budget if budget else None,
                "plan": peaks[technique]["plan"],
                "step_s": round(median, 4),
                "step_iqr_s": round(iqr, 4),
                "time_vs_plain": round(median / plain_time, 3),
                # Round by round over plain's step of the same round (interleaved: paired).
                "time_vs_plain_per_round": [
                    round(t / p, 4) for t, p in zip(times[technique], times["plain"])
                ],
                f"loss_after_{len(losses)}": losses[-1],
                "loss_diff_vs_plain": abs(losses[-1] - plain_losses[-1]),
                "exact_vs_plain": exact,
            }
        )
    for technique, reason in refused.items():
        rows.append({"model": model, "technique": technique, "batch": batch, "refused": reason})
        rows[-1].update(budget_mib=round(budgets[technique] / MIB, 1), within_budget=False, met=False)
    return rows


def largest_batch(budget_mib: float, sizes: Sizes, offload_dir: str) -> tuple[int, list[dict[str, Any]]]:
    """Biggest resnet18 batch (multiple of ``sizes.unit``) whose planner fits ``budget_mib``; the probes."""
    base, image = sizes.batch["resnet18"], sizes.image["resnet18"]
    memory = {"budget": f"{int(budget_mib * MIB)}B", "update_in_backward": True, "offload_dir": offload_dir}
    lo, hi = base, CEILING * base  # lo fits (plain itself does), hi is the search's ceiling
    probes: list[dict[str, Any]] = []
    for _ in range(sizes.probes):
        if hi - lo < sizes.unit:
            break
        mid = (lo + hi) // 2 // sizes.unit * sizes.unit
        try:
            reading = _peak("resnet18", memory, mid, image)
            fits = reading["rise"] <= budget_mib
            probe = {"batch": mid, "rise_mib": round(reading["rise"], 1), "plan": reading["plan"]}
        except KaisokuError as exc:  # the planner refused: nothing fits at this batch
            fits, probe = False, {"batch": mid, "refused": str(exc).rsplit(": ", 1)[-1]}
        probes.append({**probe, "fits": fits})
        lo, hi = (mid, hi) if fits else (lo, mid)
    return lo, probes


def accuracy_run(sizes: Sizes, work: Path) -> tuple[dict[str, dict[int, float]], str]:
    """Validation accuracy (percent) of ``kaisoku train`` runs of small-cnn on MNIST per saved-activation mode
    and seed, the modes in rotated order per seed; ({}, why) where MNIST is absent."""
    mnist = locate_mnist()
    if mnist is None:
        return {}, "mnist.npz not found (pass --mnist or set KAISOKU_MNIST)"
    acc = sizes.accuracy
    data = packed_mnist(mnist, work, acc["count"], acc["val_count"])
    out: dict[str, dict[int, float]] = {mode: {} for mode in sizes.accuracy_modes}
    modes = list(sizes.accuracy_modes)
    for index, seed in enumerate(range(acc["seeds"])):
        shift = index % len(modes)
        for mode in modes[shift:] + modes[:shift]:
            cfg = Config(run_dir=str(work / f"run-{mode}-{seed}"))
            cfg.data.path, cfg.data.global_batch, cfg.data.workers = str(data), acc["batch"], 0
            cfg.model.name = "small-cnn"
            cfg.optim.lr, cfg.sched.warmup_epochs = 0.1, 0.1
            cfg.train.epochs, cfg.train.seed = acc["epochs"], seed
            cfg.metrics.progress = False
            cfg.memory.compress = mode  # type: ignore[assignment]
            check_config(cfg, 1)
            trainer = build_trainer(cfg, World())
            summary = trainer.fit()
            trainer.metrics.close()
            out[mode][seed] = 100.0 * float(summary["val_accuracy"])
    return out, ""


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Both models, every technique, the planner, the accuracy run, the largest-batch search."""
    sizes = QUICK if quick else FULL
    work = Path(tempfile.mkdtemp(prefix="kaisoku-bench-memory-"))
    offload_dir = str(work / "offload")
    Path(offload_dir).mkdir()
    try:
        rows: list[dict[str, Any]] = []
        for model in ("resnet18", "vit"):
            rows += measure_model(model, sizes, offload_dir)
        plain = next(r for r in rows if r["model"] == "resnet18" and r["technique"] == "plain")
        best, probes = largest_batch(plain["rise_mib"], sizes, offload_dir)
        accuracy, no_accuracy = accuracy_run(sizes, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = best / sizes.batch["resnet18"]
    exact = {f"{r['model']}/{r['technique']}": r["exact_vs_plain"] for r in rows if r["technique"] in EXACT}
    planner_rows = [r for r in rows if r["technique"] in PLANNER and "refused" not in r]
    refusals = {f"{r['model']}/{r['technique']}": r["refused"] for r in rows if "refused" in r}
    within = {f"{r['model']}/{r['technique']}": r["within_budget"] for r in planner_rows}
    slowdown: dict[str, dict[str, Any]] = {}
    for name, target in (("planner-60%", "<= 1.15"), ("planner-40%", "<= 1.35")):
        ran = {r["model"]: r["time_vs_plain_per_round"] for r in planner_rows if r["technique"] == name}
        missing = {k: v for k, v in refusals.items() if k.endswith(name)}
        reason = "; ".join(f"{k} refused: {v}" for k, v in missing.items())
        if not ran and not reason:
            reason = "not run in --quick"
        slowdown[name] = worst_goal(ran, target, unit="rounds", reason=reason)
    offload_rows = [r for r in rows if "offload" in r["technique"]]
    # Signed, per seed: below 0 a compressed run is worse than plain; the worse codec is the figure.
    gaps = {
        mode: [accuracy[mode][seed] - accuracy["none"][seed] for seed in sorted(accuracy["none"])]
        for mode in accuracy
        if mode != "none"
    }
    summary = {
        "recompute_and_in_backward_exact": goal(
            float(all(exact.values())),
            ">= 1",
            exact="a bit-for-bit comparison of losses, parameters and buffers with plain's",
            per_row=exact,
            steps=1 + sizes.repeats,
        ),
        "largest_batch_ratio_resnet18": goal(
            ratio,
            ">= 2.5",
            reason="" if sizes.probes else "not searched in --quick",
            technique="planner (memory.budget) + update in backward",
            budget_rise_mib=plain["rise_mib"],
            batch=best,
            probes=probes,
            search_ceiling=CEILING * sizes.batch["resnet18"],  # a batch at the ceiling is a lower bound
        ),
        "planner_peak_within_budget": goal(
            float(all(within.values())) if within else None,
            ">= 1",
            reason="" if within else "no planner row ran",
            per_row=within,
            refused=refusals,
            measure="rise above the step's start",
        ),
        "planner_60pct_slowdown": slowdown["planner-60%"],
        "planner_40pct_slowdown": slowdown["planner-40%"],
        "compression_val_accuracy_gap_points": worst_goal(
            gaps,
            ">= -0.5",
            statistic="mean",
            unit="seeds",
            reason=no_accuracy,
            gaps_points_per_seed={mode: [round(v, 3) for v in values] for mode, values in gaps.items()},
            val_accuracy_pct={mode: list(by_seed.values()) for mode, by_seed in accuracy.items()},
            setup=dict(sizes.accuracy, model="small-cnn, SGD lr 0.1, warmup 0.1 epoch, cosine"),
        ),
        # Offload judged as what it is for: memory saved, at a bounded cost in time. The peak is one
        # deterministic step in a fresh subprocess (the same bytes every time), the time interleaved rounds.
        "offload_rise_vs_plain_worst": goal(
            max((r["rise_vs_plain"] for r in offload_rows), default=None),
            "<= 0.8",
            exact="peak bytes of one step in a fresh subprocess: the same allocations every run",
            reason="" if offload_rows else "no offload row ran",
            per_row={f"{r['model']}/{r['technique']}": r["rise_vs_plain"] for r in offload_rows},
            pinned="CUDA only (memory.offload pinned); not measured on a CPU machine",
        ),
        "offload_slowdown_worst": worst_goal(
            {f"{r['model']}/{r['technique']}": r["time_vs_plain_per_round"] for r in offload_rows},
            "<= 1.5",
            unit="rounds",
            reason="" if offload_rows else "no offload row ran",
        ),
    }
    notes = (
        f"{'quick: tiny sizes' if quick else 'full'}; images {sizes.image} px, batches {sizes.batch} (cut "
        "from the issue's 256 to keep the full run within 8 minutes on 2 CPU cores); vit = vit-tiny (6 layers, "
        f"width 192, patch 4); SGD momentum 0.9, fp32; exactness over {1 + sizes.repeats} steps (the timed ones); "
        f"step time median of {sizes.repeats} interleaved rounds; planner rows run memory.budget with "
        "memory.update_in_backward, their budgets fractions of plain's rise (peak above the memory held when the step began: activations, gradients, temporaries), the "
        f"quantity memory.budget bounds; largest batch: at most {sizes.probes} probes in multiples of "
        f"{sizes.unit}, ceiling {CEILING}x; peak_mib includes the process baseline (torch and Python)."
    )
    columns = {key: key for row in rows for key in row}
    return record_and_show("memory", out_dir, summary, rows, columns, quick=quick, notes=notes)
