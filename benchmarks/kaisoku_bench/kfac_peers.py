"""The K-FAC benchmark's peer and picture: ASDL's K-FAC (single process, where installed) and the curves.

ASDL drives its own forward and backward (``KfacGradientMaker``), so its row trains in a loop of its own, on
the same tensors, model and sample order keyed by (seed, epoch) as kaisoku's rows.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kaisoku.models.zoo import SmallCNN
from kaisoku_bench.training import npz_splits

# ---------------------------------------------------------------------------------------------------------
# ASDL peer (single process), where installed.


#: ASDL has no KL clipping; with the damping K-FAC uses here (3e-3) its updates diverge within a few steps
#: on this model, 0.3 trains.
ASDL_DAMPING = 0.3
#: Wall-clock limit of the ASDL run (training and evaluation): it reached the target in about 35 s when
#: last recorded; the limit keeps the whole benchmark within its 15 minutes.
ASDL_TIME_LIMIT_S = 60.0


def asdl_row(
    plan: dict[str, Any], data_path: Path, best_lr: float, quick: bool, target: float
) -> dict[str, Any]:
    """ASDL's K-FAC in front of momentum SGD, single process, until ``target`` test accuracy; or why not.

    ``plan``: the benchmark's plan as a dict (its batch, cap, evaluation interval and K-FAC intervals).
    """
    if importlib.util.find_spec("asdl") is None:
        return {"method": "asdl-kfac (1 process)", "status": "skipped: asdl (asdfghjkl) not installed"}
    if quick:
        return {
            "method": "asdl-kfac (1 process)",
            "status": "skipped in --quick (runs in the full benchmark)",
        }
    try:
        return _asdl_run(plan, data_path, best_lr, target)
    except Exception as error:  # a peer that fails to run is reported, not fatal
        return {"method": "asdl-kfac (1 process)", "status": f"failed: {type(error).__name__}: {error}"}


def _asdl_run(
    plan: dict[str, Any], data_path: Path, lr: float, target: float
) -> dict[str, Any]:  # pragma: no cover - optional peer
    import asdl

    torch.manual_seed(plan["seed"])
    limits = {"train": plan["train_limit"], "test": plan["eval_limit"]}
    data = {split: dataset.tensors for split, dataset in npz_splits(data_path, limits).items()}
    model = SmallCNN(width=16)
    kfac = plan["kfac_options"]
    batch = plan["global_batch"]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    config = asdl.PreconditioningConfig(
        data_size=batch,
        damping=ASDL_DAMPING,
        curvature_upd_interval=kfac.get("factor_update_steps", 1),
        preconditioner_upd_interval=kfac.get("inv_update_steps", 10),
        ema_decay=1.0 - kfac.get("factor_decay", 0.95),
    )
    gradmaker = asdl.KfacGradientMaker(model, config)
    x_train, y_train = data["train"]
    steps_per_epoch = len(x_train) // batch
    wall, reached, acc = 0.0, None, float("nan")
    order = np.empty(0, dtype=np.int64)
    deadline = time.monotonic() + ASDL_TIME_LIMIT_S
    for step in range(int(plan["max_epochs"] * steps_per_epoch)):
        if time.monotonic() > deadline:
            break
        epoch, index = divmod(step, steps_per_epoch)
        if index == 0:
            order = np.random.default_rng([plan["seed"], epoch]).permutation(len(x_train))
        chosen = torch.from_numpy(order[index * batch : (index + 1) * batch])
        x, y = x_train[chosen], y_train[chosen]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        dummy_y = gradmaker.setup_model_call(model, x)
        gradmaker.setup_loss_call(F.cross_entropy, dummy_y, y)
        gradmaker.forward_and_backward()
        optimizer.step()
        wall += time.perf_counter() - start
        if (step + 1) % plan["eval_every"] == 0:
            with torch.no_grad():
                model.eval()
                x_test, y_test = data["test"]
                acc = float((model(x_test).argmax(1) == y_test).float().mean())
                model.train()
            if acc >= target:
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


def plot_curves(runs: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy against training wall time (measured, interleaved), every race; the target dashed."""
    targets = [run["target"] for run in runs if "target" in run]
    target = float(np.median(targets)) if targets else 0.0
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = {"sgd": "tab:blue", "lars": "tab:orange", "kfac": "tab:green"}
    # Left: the whole run; right: zoomed on the target.
    for ax, bottom in zip(axes, (0.0, max(0.0, target - 0.05))):
        seen: set[str] = set()
        for run in runs:
            if not run["curve"]:
                continue
            knob = "kl_clip" if run["method"] == "kfac" else "lr"
            label = (
                None
                if run["method"] in seen
                else f"{run['method']} ({knob} {run['lr']:g}, cosine over {run['horizon']:.3g} epochs)"
            )
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
    batch = runs[0]["batch"] if runs else "?"
    fig.suptitle(f"MNIST, small-cnn (width 16), global batch {batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
