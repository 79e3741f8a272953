"""``kaisoku bench memory``: peak memory, step time and exactness of each memory technique against plain.

Every row is one (model, technique) built with the objects ``kaisoku train`` builds: ``build_model`` (or
torchvision's VisionTransformer), ``build_optimizer`` (SGD, momentum 0.9), ``build_scheduler``,
:func:`~kaisoku.memory.checkpointing.apply_recompute`,
:func:`~kaisoku.memory.in_backward.attach_update_in_backward` and the
:class:`~kaisoku.engine.step.DataParallelStep` engine, trained on synthetic batches keyed by step index.

- Peak memory: :func:`kaisoku.memory.measure.measure_in_subprocess` (own subprocess, one warm-up step,
  peak reset, one step; VmHWM on the CPU, ``max_memory_allocated`` on CUDA).
- Step time: one training step per call, the techniques of a model interleaved round by round; median.
- Exactness: the timed steps (a warm-up and one per round) start from the same initial weights and run
  the same batches; the losses and final weights are compared with plain's bit for bit.
- Largest batch: binary search (multiples of a unit) for the biggest batch whose peak with the strongest
  implemented combination (per-block recomputation + update in backward) stays within plain's peak at the
  reference batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kaisoku.bench.common import goal, interleaved, median_iqr, record_and_show
from kaisoku.config import OptimConfig, SchedConfig
from kaisoku.engine.step import DataParallelStep, Precision
from kaisoku.memory.checkpointing import apply_recompute
from kaisoku.memory.in_backward import attach_update_in_backward
from kaisoku.memory.measure import measure_in_subprocess
from kaisoku.models.zoo import build_model
from kaisoku.optim.factory import build_optimizer, build_scheduler

#: Technique -> (memory.recompute, memory.update_in_backward).
TECHNIQUES: dict[str, tuple[str, bool]] = {
    "plain": ("none", False),
    "recompute-blocks": ("blocks", False),
    "recompute-selective": ("selective", False),
    "update-in-backward": ("none", True),
    "blocks+in-backward": ("blocks", True),
}
STRONGEST = "blocks+in-backward"
MIB = float(1 << 20)
NOT_YET = "not implemented yet"


@dataclass(frozen=True)
class Sizes:
    """The run's sizes: full or --quick."""

    image: int
    batch: dict[str, int]
    vit_layers: int
    vit_width: int
    repeats: int
    unit: int
    probes: int
    techniques: tuple[str, ...] = tuple(TECHNIQUES)


FULL = Sizes(
    image=64,
    batch={"resnet18": 256, "vit": 128},
    vit_layers=6,
    vit_width=256,
    repeats=3,
    unit=32,
    probes=3,
)
QUICK = Sizes(
    image=32,
    batch={"resnet18": 16, "vit": 16},
    vit_layers=2,
    vit_width=64,
    repeats=3,
    unit=8,
    probes=0,
    techniques=("plain", "recompute-selective", STRONGEST),
)


def _model(name: str, image: int, vit_layers: int, vit_width: int) -> nn.Module:
    if name == "vit":
        from torchvision.models import VisionTransformer

        return VisionTransformer(
            image_size=image,
            patch_size=8,
            num_layers=vit_layers,
            num_heads=4,
            hidden_dim=vit_width,
            mlp_dim=4 * vit_width,
            num_classes=10,
        )
    return build_model(name, num_classes=10)


class Setup:
    """One (model, technique) as ``kaisoku train`` builds it, with batches keyed by step index."""

    def __init__(
        self,
        model: str,
        technique: str,
        *,
        batch: int,
        image: int,
        vit_layers: int,
        vit_width: int,
        seed: int = 0,
    ) -> None:
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(seed)
        net = _model(model, image, vit_layers, vit_width).to(self.device)
        recompute, in_backward = TECHNIQUES[technique]
        apply_recompute(net, recompute)  # type: ignore[arg-type]
        optimizer = build_optimizer(net, OptimConfig(name="sgd", lr=0.05, momentum=0.9))
        if in_backward:
            attach_update_in_backward(net, optimizer)
        scheduler = build_scheduler(optimizer, SchedConfig(), steps_per_epoch=100, total_steps=1000)
        self.engine = DataParallelStep(
            net,
            optimizer,
            scheduler,  # type: ignore[arg-type]
            loss_fn=nn.CrossEntropyLoss(),
            precision=Precision("fp32", self.device),
            update_in_backward=in_backward,
        )
        self.batch, self.image, self.seed, self.index = batch, image, seed, 0
        self.losses: list[float] = []

    def data(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of step ``index`` (the same for every technique)."""
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        images = torch.randn(self.batch, 3, self.image, self.image, generator=gen)
        labels = torch.randint(0, 10, (self.batch,), generator=gen)
        return images.to(self.device), labels.to(self.device)

    def step(self) -> dict[str, float]:
        """One training step on the next batch; its loss."""
        loss = self.engine.train_step([self.data(self.index)])
        self.index += 1
        self.losses.append(float(loss))
        return {"loss": float(loss)}


def build_step(**kwargs: Any) -> tuple[Callable[[], dict[str, float]], torch.device]:
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


def _peak(model: str, technique: str, batch: int, sizes: Sizes) -> tuple[float, float]:
    """Peak of one step in MiB, and how far it rose above the memory held when the step began."""
    kwargs = {"model": model, "technique": technique, "batch": batch, "image": sizes.image}
    kwargs.update(vit_layers=sizes.vit_layers, vit_width=sizes.vit_width)
    reading = measure_in_subprocess("kaisoku.bench.memory:build_step", kwargs)
    return reading.peak_bytes / MIB, (reading.peak_bytes - reading.before_bytes) / MIB


def measure_model(model: str, sizes: Sizes) -> list[dict[str, Any]]:
    """Every technique on ``model``: peak (MiB), step time (interleaved median), exactness vs plain."""
    batch = sizes.batch[model]
    common = {
        "batch": batch,
        "image": sizes.image,
        "vit_layers": sizes.vit_layers,
        "vit_width": sizes.vit_width,
    }
    peaks = {technique: _peak(model, technique, batch, sizes) for technique in sizes.techniques}
    # Every setup starts from the same weights and runs the same batches in the same order (its own
    # step index), so the timed steps double as the exactness run: warm-up + repeats steps each.
    setups = {technique: Setup(model, technique, **common) for technique in sizes.techniques}
    for setup in setups.values():
        setup.step()  # warm-up outside the timing
    times = interleaved({t: _timed(s) for t, s in setups.items()}, sizes.repeats)
    finals = {
        t: (s.losses, {k: v.detach().cpu() for k, v in s.engine.model.state_dict().items()})
        for t, s in setups.items()
    }
    del setups
    plain_losses, plain_state = finals["plain"]
    plain_time = median_iqr(times["plain"])[0]
    rows = []
    for technique in sizes.techniques:
        losses, state = finals[technique]
        median, iqr = median_iqr(times[technique])
        exact = losses == plain_losses and all(torch.equal(state[k], plain_state[k]) for k in plain_state)
        rows.append(
            {
                "model": model,
                "technique": technique,
                "batch": batch,
                "peak_mib": round(peaks[technique][0], 1),
                "peak_vs_plain": round(peaks[technique][0] / peaks["plain"][0], 3),
                "rise_mib": round(peaks[technique][1], 1),
                "rise_vs_plain": round(peaks[technique][1] / peaks["plain"][1], 3),
                "step_s": round(median, 4),
                "step_iqr_s": round(iqr, 4),
                "time_vs_plain": round(median / plain_time, 3),
                f"loss_after_{len(losses)}": losses[-1],
                "exact_vs_plain": exact,
            }
        )
    return rows


def largest_batch(model: str, budget_mib: float, sizes: Sizes) -> tuple[int, list[dict[str, Any]]]:
    """Biggest multiple of ``sizes.unit`` whose peak with :data:`STRONGEST` fits ``budget_mib``; the probes."""
    base = sizes.batch[model]
    lo, hi = base, 4 * base  # lo fits (it needs less than plain), hi is the search's ceiling
    probes: list[dict[str, Any]] = []
    for _ in range(sizes.probes):
        if hi - lo < sizes.unit:
            break
        mid = (lo + hi) // 2 // sizes.unit * sizes.unit
        peak = _peak(model, STRONGEST, mid, sizes)[0]
        probes.append({"batch": mid, "peak_mib": round(peak, 1), "fits": peak <= budget_mib})
        lo, hi = (mid, hi) if peak <= budget_mib else (lo, mid)
    return lo, probes


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Both models, every technique, the largest-batch search; ``memory.json``."""
    sizes = QUICK if quick else FULL
    rows: list[dict[str, Any]] = []
    for model in ("resnet18", "vit"):
        rows += measure_model(model, sizes)
    plain = next(r for r in rows if r["model"] == "resnet18" and r["technique"] == "plain")
    best, probes = largest_batch("resnet18", plain["peak_mib"], sizes)
    ratio = best / sizes.batch["resnet18"]
    exact = {f"{r['model']}/{r['technique']}": r["exact_vs_plain"] for r in rows}
    planner = "the budget planner (memory.budget) is " + NOT_YET
    summary = {
        "recompute_and_in_backward_exact": goal(
            float(all(exact.values())), ">= 1", per_row=exact, steps=1 + sizes.repeats
        ),
        "largest_batch_ratio_resnet18": goal(
            ratio,
            ">= 2.5",
            reason="" if sizes.probes else "not searched in --quick",
            technique=STRONGEST,
            budget_mib=plain["peak_mib"],
            batch=best,
            probes=probes,
            search_ceiling=4 * sizes.batch["resnet18"],  # a batch at the ceiling is a lower bound
        ),
        "planner_peak_within_budget": goal(None, "<= 1", reason=planner),
        "planner_60pct_slowdown": goal(None, "<= 1.15", reason=planner),
        "planner_40pct_slowdown": goal(None, "<= 1.35", reason=planner),
        "compression_val_accuracy_gap_points": goal(
            None,
            "<= 0.5",
            reason="saved-activation compression (memory.compress) is not measured by this benchmark yet",
        ),
        "offload_rows": goal(
            None, ">= 1", reason="activation offload (pinned host, out-of-core) is " + NOT_YET
        ),
    }
    notes = (
        f"{'quick: tiny sizes' if quick else 'full'}; image {sizes.image} px, batches {sizes.batch}, ViT "
        f"{sizes.vit_layers} layers width {sizes.vit_width} patch 8; SGD momentum 0.9, fp32; exactness over "
        f"{1 + sizes.repeats} steps (the timed ones); step time median of {sizes.repeats} interleaved rounds; largest batch: at most "
        f"{sizes.probes} probes in multiples of {sizes.unit}, ceiling 4x. The ViT runs batch "
        f"{sizes.batch['vit']} to keep the full run within minutes on 2 CPU cores. peak_mib includes the process's baseline (torch and "
        "Python), which no technique reduces; rise_mib is the peak above the memory held when the step began."
    )
    columns = {key: key for key in rows[0]}
    return record_and_show("memory", out_dir, summary, rows, columns, quick=quick, notes=notes)
