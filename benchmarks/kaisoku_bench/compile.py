"""``kaisoku bench compile``: training-step time with ``train.compile`` against eager, and compile time.

Each case builds its model and optimizer with ``kaisoku train``'s builders; every way (off, model,
optimizer, all) is compiled and warmed up by :func:`kaisoku.engine.compile.prepare_way`, then timed one step
per round, interleaved. ``auto`` is judged as a user meets it: the way
:func:`~kaisoku.engine.compile.compile_for_training` picks from its own trial, against eager. Setup and
goal: ``benchmarks/README.md``, section compile.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from kaisoku.config import OptimConfig
from kaisoku.engine.compile import Trial, compile_for_training, prepare_way, synthetic_batch
from kaisoku.models.zoo import build_model
from kaisoku.optim.factory import build_optimizer
from kaisoku_bench.common import bench_device, interleaved, median_iqr, print_table, write_result
from kaisoku_bench.goals import paired_ratios, worst_goal

#: Case name -> (model, stem, input shape of one batch, classes).
CASES: dict[str, tuple[str, str, tuple[int, int, int, int], int]] = {
    "small-cnn": ("small-cnn", "small", (128, 1, 28, 28), 10),
    "resnet10": ("resnet10", "small", (64, 3, 24, 24), 10),
    "vit-tiny": ("vit-tiny", "small", (32, 1, 32, 32), 10),
}
WAYS = ("off", "model", "optimizer", "all")


def measure_case(
    case: str, *, ways: tuple[str, ...], repeats: int, judge_auto: bool = True
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows (one per way) and the auto verdict of ``case`` (None when ``judge_auto`` is off)."""
    name, stem, shape, classes = CASES[case]
    torch.manual_seed(0)
    device = bench_device()
    model = build_model(name, num_classes=classes, stem=stem, in_channels=shape[1], size=shape[-1])
    model = model.to(device)
    optimizer = build_optimizer(model, OptimConfig(name="sgd", lr=0.05))
    loss_fn = torch.nn.CrossEntropyLoss()
    batch = synthetic_batch(shape, classes, device, seed=0)
    trial = Trial(loss_fn, batch, contextlib.nullcontext)
    warmups: dict[str, float] = {}
    steps = {}
    for way in ways:
        warmups[way], steps[way] = prepare_way(way, model, optimizer, trial)
    times = interleaved(steps, repeats)
    eager_ms = median_iqr(times["off"])[0] * 1e3
    rows = []
    for way in ways:
        median, iqr = median_iqr(times[way])
        rows.append(
            {
                "case": case,
                "way": way,
                "step_ms": round(median * 1e3, 2),
                "iqr_ms": round(iqr * 1e3, 2),
                "vs_eager": round(median * 1e3 / eager_ms, 3),
                "compile_s": round(max(0.0, warmups[way] - warmups["off"]), 1),
            }
        )
    if not judge_auto:
        return rows, None
    started = time.perf_counter()
    report = compile_for_training(
        "auto", model, optimizer, loss_fn=loss_fn, batch=batch, autocast=contextlib.nullcontext
    )
    kept = times.get(report.mode)
    auto = {
        "case": case,
        "auto_kept": report.mode,
        "auto_trial_s": round(time.perf_counter() - started, 1),
        "auto_vs_eager": next((row["vs_eager"] for row in rows if row["way"] == report.mode), None),
        # Per round, the kept way's step over the eager step of the same round (interleaved: paired).
        "auto_vs_eager_per_round": paired_ratios(kept, times["off"]) if kept else None,
    }
    return rows, auto


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Every case and way, the auto verdicts, the table and ``compile.json``."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # --quick checks the machinery on eager only: a cold inductor compile alone takes about a minute
        # on 2 cores, and compiled == eager is tested in tests/engine/test_compile.py.
        cases = ("small-cnn",) if quick else tuple(CASES)
        ways = ("off",) if quick else WAYS
        repeats = 5 if quick else 21
        rows: list[dict[str, Any]] = []
        autos: list[dict[str, Any]] = []
        for case in cases:
            case_rows, auto = measure_case(case, ways=ways, repeats=repeats, judge_auto=not quick)
            rows += case_rows
            if auto is not None:
                autos.append(auto)
    finally:
        torch.set_num_threads(previous_threads)
    missing = [case for case in CASES if case not in {auto["case"] for auto in autos}]
    unjudged = [auto["case"] for auto in autos if not auto["auto_vs_eager_per_round"]]
    reason = f"compiled ways not measured in --quick: {', '.join(missing)}" if missing else ""
    if unjudged and not reason:
        reason = f"auto kept a way not among the interleaved rows in {', '.join(unjudged)}"
    summary = {
        "auto_vs_eager_worst": worst_goal(
            {auto["case"]: auto["auto_vs_eager_per_round"] or [] for auto in autos},
            "<= 1.03",
            unit="rounds",
            reason=reason,
        ),
    }
    print_table("compile: step time by way", rows + autos, summary)
    return write_result(
        "compile",
        out_dir,
        summary,
        rows + autos,
        quick=quick,
        notes=(
            f"{bench_device().type.upper()}, 1 torch thread, SGD momentum 0.9, fixed synthetic batch; one training step per row "
            "(forward, backward, optimizer step), rows interleaved, median. compile_s: warm-up (3 steps) "
            "minus the eager warm-up. auto: the way compile_for_training('auto') kept from its own 20-step "
            "trial, judged by the interleaved rows."
        ),
        extra={"torch_threads": 1, "repeats": repeats},
    )
