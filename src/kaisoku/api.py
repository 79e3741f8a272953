"""Training your own model from Python: :func:`fit` and :func:`launch`.

::

    import kaisoku

    def main() -> None:
        cfg = kaisoku.Config()
        cfg.optim.name = "lars"
        kaisoku.fit(cfg, model=MyNet(), data=my_dataset, val_data=my_val_set)

    if __name__ == "__main__":
        kaisoku.launch(main, nproc=2)   # 2 local ranks; unchanged under torchrun or srun

:func:`fit` builds the same run ``kaisoku train`` builds (the plan, the engine, checkpoints, metrics, the
report) around the given parts, so they get every feature the zoo's models get.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kaisoku.config import Config, validate
from kaisoku.distributed.env import inside_slurm_step, inside_torchrun, planned_world_size, world_from_env
from kaisoku.distributed.launch import launch_local
from kaisoku.engine.build import user_parts
from kaisoku.engine.failures import leave_finished_rank
from kaisoku.engine.run import run_training
from kaisoku.engine.trial import trial_step
from kaisoku.engine.user_metrics import MetricsArg, named_metrics
from kaisoku.errors import KaisokuError
from kaisoku.parts import LossFn, ModelSource, UserParts
from kaisoku.run_facts import plan_run
from kaisoku.run_plan import WorldShape

#: How long a rank that refuses silently waits for rank 0 (which says why) to exit first: the launcher
#: (torchrun's agent, ``srun --kill-on-bad-exit``) stops it sooner; bounded for launchers that do not.
_SILENT_RANK_WAIT_S = 60.0
#: Set in the environment of the ranks :func:`launch` starts: such a rank leaves once ``main`` returns.
_LAUNCHED_RANK_ENV = "KAISOKU_LAUNCHED_RANK"


def fit(
    config: Config | None = None,
    *,
    model: ModelSource | None = None,
    data: Any = None,
    val_data: Any = None,
    loss: LossFn | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    metrics: MetricsArg | None = None,
) -> dict[str, Any]:
    """Train ``model`` on ``data`` with every setting of ``config`` on the world this process is in.

    ``model``: an ``nn.Module``, or a factory called with the run's :class:`~kaisoku.parts.ModelSpec`
    (pipeline parallelism and the memory planner need its ordered blocks: an ``nn.Sequential`` or an
    ``ordered_blocks()`` method). ``data`` / ``val_data``: map-style datasets of ``(input, target)`` pairs or
    of dicts (the model then gets a batch as keyword arguments; the target is its ``labels`` entry) (None:
    ``config``'s ``data.path`` or ``data.dataset``). ``loss``: ``loss(outputs, targets)``, ``targets`` the
    whole batch for dict samples; None: the model's own loss where its output carries one, else the task's
    (cross-entropy, per token for token targets, or mean squared error). ``collate_fn``: makes a batch of a
    list of samples (None: torch's default). ``metrics``: validation metrics of your own, one, a list or a
    dict of name to metric: functions ``metric(outputs, targets)`` returning a batch's mean, or torchmetrics
    metrics; each is reported as ``val_<name>``, reduced over every rank (:mod:`kaisoku.engine.user_metrics`).
    Returns the run's summary, the same on every rank.

    Under torchrun or srun every rank calls it; elsewhere it trains on this one process (see :func:`launch`
    for several local ranks). Settings that cannot work, and any known failure, print one line and exit with
    its code, as ``kaisoku train`` does.
    """
    cfg = config if config is not None else Config()
    world = world_from_env()
    try:
        validate(cfg)
        given = UserParts(
            model=model,
            train_data=data,
            val_data=val_data,
            loss=loss,
            collate=collate_fn,
            metrics=named_metrics(metrics) if metrics is not None else None,
        )
        parts = user_parts(cfg, given)
        plan = plan_run(cfg, WorldShape(world.world_size, world.local_world_size), parts)  # refuse here
        trial_step(plan, parts)  # the model, loss and metrics on two samples, before any collective
        return run_training(cfg, parts=parts, plan=plan)
    except KaisokuError as error:  # refused before training (a failure while training exits on its own)
        if world.is_main:  # every rank refuses alike; one says so
            print(f"kaisoku: error: {in_python_terms(str(error))}", file=sys.stderr, flush=True)
        elif world.world_size > 1:
            # The launcher stops every rank once one exits; a silent rank that exited first would stop rank 0
            # before its line was printed and be reported as the cause. It waits for rank 0 to go first.
            time.sleep(_SILENT_RANK_WAIT_S)
        raise SystemExit(error.exit_code) from None


#: The command line's spelling of a remedy -> the same setting as a ``fit`` caller writes it.
_PYTHON_TERMS = (
    ("pass --resume auto", 'set cfg.checkpoint.resume = "auto"'),
    ("--resume auto", 'cfg.checkpoint.resume = "auto"'),
    ("choose a new --run-dir", "choose a new cfg.run_dir"),
    ("choose another --run-dir", "choose another cfg.run_dir"),
)


def in_python_terms(message: str) -> str:
    """A refusal's remedy as a Python caller sets it (``cfg.checkpoint.resume = "auto"``, not ``--resume``)."""
    for flag, setting in _PYTHON_TERMS:
        message = message.replace(flag, setting)
    return message


def seed_alike(seed: int = 0) -> None:
    """Seed torch's, NumPy's and Python's generators with ``seed``: the same numbers on every rank."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def launch(main: Callable[[], Any], *, nproc: int = 0, max_restarts: int = 0) -> Any:
    """Run ``main`` on ``nproc`` local ranks (0: one per GPU, else 2) and return its result on a rank.

    Under torchrun or srun (or with ``nproc`` 1) ``main`` just runs here: the same script works on a laptop,
    under ``torchrun --nproc-per-node 8 script.py`` and in an ``srun`` step. Elsewhere the script is started
    again on ``nproc`` ranks through torchrun's own launcher (``--standalone``), each of which runs ``main``;
    the launcher returns None when every rank succeeded. When one failed, the launcher exits with its exit
    code (the rank printed why: one line for a known failure, e.g. code 2 for settings ``fit`` refuses), or
    with one line and code 1 when a signal killed it.

    A rank this function started leaves once ``main`` returns (its exit functions run; the interpreter's
    teardown, which torch's threads can abort under load, is skipped), so the code after ``launch`` runs
    once, in the calling process, which gets None.

    Before ``main`` runs, every rank seeds torch's, NumPy's and Python's generators alike (with 0), so that
    data ``main`` builds with randomness (a random split, generated samples) is the same on every rank;
    ``fit`` checks that every rank holds the same dataset. Training's own randomness is keyed by
    ``train.seed``.
    """
    if inside_torchrun() or inside_slurm_step():
        seed_alike()
        result = main()
        if os.environ.get(_LAUNCHED_RANK_ENV) == "1":
            leave_finished_rank()
        return result
    ranks = planned_world_size(nproc)
    if ranks == 1:
        seed_alike()
        return main()
    if not sys.argv or not sys.argv[0] or sys.argv[0] in ("-c", "-"):
        raise KaisokuError(
            "kaisoku.launch needs a script file to start on each rank; run it as python SCRIPT.py"
        )
    result = launch_local(
        [sys.argv[0], *sys.argv[1:]], nproc=ranks, max_restarts=max_restarts, env={_LAUNCHED_RANK_ENV: "1"}
    )
    if result.ok:
        return None
    if result.interrupted:
        print("kaisoku: interrupted", file=sys.stderr)
        raise SystemExit(130)
    first = result.failures[0]
    if first.signal:  # it could not say why itself
        print(f"kaisoku: error: rank {first.rank} died ({first.how})", file=sys.stderr)
    # Otherwise the rank said why (and where its logs are, when it had a run folder): its code is the run's.
    raise SystemExit(first.exit_code)
