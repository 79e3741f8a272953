"""``kaisoku bench cluster``: many hosts in a cluster in a box (Linux, root; see
:mod:`kaisoku.testing.cluster`).

Measured: an elastic run (``--nnodes 1:2 --max-restarts 1``, 2 hosts of one rank, small-cnn on a 160-image
shapes set) loses host 1 (every process on it killed) and gets it back (its launcher started again with
the same command). From the loss to training again, split into *detection* (the kill to the surviving
rank's failure record), *rendezvous* (to the restarted rank's process running: torchrun dropping the
dead host, waiting for others, starting the process; the rank log's header, to the second) and *resume*
(to its first trained step: process group, build, checkpoint load, data); from the return to training
at full size, split into *join* (the launcher started to the ranks' processes running) and *resume*. The 1-host world holds after its first checkpoint until the host returns
(:mod:`kaisoku_bench.cluster_rank`), so that the return always meets a running run.

``--quick`` loses the host without its return, with short rendezvous clocks (:data:`QUICK_CLOCKS`) in
place of torchrun's heartbeats: a smoke run of a minute, not the figure.

Weak scaling of loading and exchange over 1, 2 and 4 hosts, and the planner (``kaisoku probe`` on host 0,
then ``kaisoku plan``'s model) against the epochs of those cells and of a second, asymmetric box:
:mod:`kaisoku_bench.cluster_scaling`. On that box's 2-host cell every strategy ``kaisoku plan`` compares
runs too, and its recommendation's measured epoch is judged against the fastest measured strategy of
equal or better shuffle quality (:func:`recommendation_vs_fastest`).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from kaisoku.config import Config, apply_override, to_toml
from kaisoku.data.datagen import generate
from kaisoku.data.shards.writer import pack
from kaisoku.testing.cluster import BoxUnavailable, ClusterBox, Link, unavailable_reason
from kaisoku.testing.sshfs import unavailable_reason as sshfs_unavailable_reason
from kaisoku_bench import cluster_scaling as scaling
from kaisoku_bench.cluster_rank import CLOCKS_FLAG, HOLD_FLAG, MODULE
from kaisoku_bench.common import goal, print_table, python_path, write_result

ENDPOINT = "kbox-node0:29400"
STEPS_EVERY = 4
RECOVERY_GOAL_S = "<= 60"
NOT_MEASURED = "not measured by this version of bench cluster"
RECOMMENDATION_GOAL = "<= 1.10"
EQUAL_QUALITY_RULE = (
    "candidates: every strategy whose quality in kaisoku plan's table is >= the recommended one's; "
    "per repeat (each repeat's cells measured in one rotation), recommended / the fastest candidate of that "
    "repeat (the recommendation included), so a recommendation that is fastest by median still shows the "
    "repeats it lost; value: the median of those ratios; fastest_equal_quality: the lowest median epoch"
)
#: ``--quick``'s rendezvous clocks (heartbeat every 1 s, a host dropped after 3 missed, 1 s of last call):
#: torchrun's defaults (5 s, 3, and kaisoku's 5 s last call) spend ~30 s of a one-minute smoke run waiting.
QUICK_CLOCKS = "1:3:1"


def _settings(box: ClusterBox, run_dir: Path) -> dict[str, str]:
    """The run every host starts (dotted config keys): the shared set, each host's own disk and RAM."""
    return {
        "run_dir": str(run_dir),
        "data.path": str(box.shared_dir),
        "data.local_cache": str(box.local_dir),
        "data.local_capacity": "64MiB",
        "data.ram_dir": "/dev/shm/kaisoku",
        "data.image_size": "16",
        "data.global_batch": "8",
        "data.workers": "0",
        "model.name": "small-cnn",
        "train.epochs": "2",
        "train.log_every": "1",
        "metrics.progress": "false",
        "dist.nproc": "1",
        "dist.nnodes": "1:2",
        "dist.max_restarts": "1",
        "dist.rdzv_endpoint": ENDPOINT,
        "dist.timeout": "60",
        "checkpoint.every_steps": str(STEPS_EVERY),
        "checkpoint.resume": "auto",
    }


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl so far (a line being written is skipped)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _attempts(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run_dir / "hosts.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return []


def _wait(what: str, condition: Any, timeout: float, procs: list[subprocess.Popen[Any]]) -> None:
    """Poll ``condition`` every 0.2 s; RuntimeError naming ``what`` after ``timeout`` s or when a host's
    launcher exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        if any(proc.poll() not in (None, -9) for proc in procs):
            raise RuntimeError(f"a host's launcher exited while waiting for {what}")
        time.sleep(0.2)
    raise RuntimeError(f"no {what} within {timeout:g} s")


def _stamp(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["time"]).timestamp()


def _rank_started(run_dir: Path, attempt: int) -> float:
    """When rank 0 of ``attempt`` (the rendezvous round) began: its log's header, to the second."""
    text = (run_dir / "logs" / "rank-0.log").read_text(errors="replace")
    pattern = rf"=== kaisoku rank 0 on \S+, (\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d), restart {attempt} ==="
    found = re.findall(pattern, text)
    if not found:
        raise RuntimeError(f"rank 0 of attempt {attempt} left no header in {run_dir}/logs/rank-0.log")
    return time.mktime(time.strptime(found[-1], "%Y-%m-%d %H:%M:%S"))


def _first_step_after(records: list[dict[str, Any]], start: float) -> float:
    """When the first step trained after ``start`` (a Unix time) was logged."""
    return min(_stamp(r) for r in records if "loss" in r and _stamp(r) > start)


def loss_and_return(
    box: ClusterBox, work: Path, repeat: int, clocks: str = "", *, regain: bool = True
) -> dict[str, Any]:
    """One elastic run that loses host 1 and gets it back; the seconds of each part (one row).

    ``clocks``: the launchers' rendezvous clocks as ``S:N:L`` (:mod:`kaisoku_bench.cluster_rank`); empty:
    ``kaisoku train``'s. ``regain=False``: the run ends (host 0 killed) once the 1-host world has
    checkpointed; the row has the loss's parts only."""
    run_dir = work / f"run-{repeat}"
    cfg = Config()
    for key, value in _settings(box, run_dir).items():
        apply_override(cfg, key, value)
    config = work / f"cluster-{repeat}.toml"
    config.write_text(to_toml(cfg))
    argv = [sys.executable, "-m", MODULE, HOLD_FLAG, f"2:{STEPS_EVERY}"]
    argv += [CLOCKS_FLAG, clocks] if clocks else []
    argv += ["--config", str(config)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = python_path(env.get("PYTHONPATH", ""))

    def start(host: int, tag: str) -> subprocess.Popen[Any]:
        with (work / f"host{host}-{repeat}-{tag}.log").open("w") as log:
            return box.popen(host, argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT)

    procs = [start(0, "first"), start(1, "first")]

    def trained_together() -> bool:
        # With a short last call the first round may hold host 0 alone until host 1 arrives.
        attempts = _attempts(run_dir)
        if not attempts or attempts[-1]["world_size"] != 2:
            return False
        since = attempts[-1]["start_step"]
        return sum("loss" in r and r["step"] > since for r in _records(run_dir)) >= 6

    _wait("6 steps trained by 2 hosts", trained_together, 240, procs)
    killed_at = time.time()
    box.kill_host(1)
    procs[1].wait(30)

    def checkpointed_alone() -> bool:
        attempts = _attempts(run_dir)
        if len(attempts) < 2 or [a["world_size"] for a in attempts[-2:]] != [2, 1]:
            return False
        due = attempts[-1]["start_step"] + STEPS_EVERY
        return any(r.get("event") == "checkpoint" and r.get("step") == due for r in _records(run_dir))

    _wait("checkpoint of the 1-host world", checkpointed_alone, 240, procs[:1])
    # Read now: the returning launcher clears the failure records of the previous start.
    detected_at = json.loads((run_dir / "logs" / "failure-rank-0.json").read_text())["time"]
    if not regain:
        alone_start = _rank_started(run_dir, _attempts(run_dir)[-1]["attempt"])
        box.kill_host(0)
        procs[0].wait(30)
        return {"repeat": repeat, **_loss_parts(killed_at, detected_at, alone_start, _records(run_dir))}
    back_at = time.time()
    procs.append(start(1, "back"))
    for proc in (procs[0], procs[2]):
        if proc.wait(300) != 0:
            raise RuntimeError(f"a host's launcher exited with {proc.returncode}; see {work}/host*.log")
    records = _records(run_dir)
    attempts = _attempts(run_dir)
    if [a["world_size"] for a in attempts[-3:]] != [2, 1, 2]:
        raise RuntimeError(f"the world did not go 2 -> 1 -> 2 ranks: {attempts}")
    alone_start = _rank_started(run_dir, attempts[-2]["attempt"])
    back_start = _rank_started(run_dir, attempts[-1]["attempt"])
    join = max(0.0, back_start - back_at)  # the header is to the second (see _loss_parts)
    resumed_back = _first_step_after(records, back_start) - (back_at + join)
    return {
        "repeat": repeat,
        **_loss_parts(killed_at, detected_at, alone_start, records),
        "return_join_s": round(join, 2),
        "return_resume_s": round(resumed_back, 2),
        "return_to_training_s": round(join + resumed_back, 2),
    }


def _loss_parts(
    killed_at: float, detected_at: float, alone_start: float, records: list[dict[str, Any]]
) -> dict[str, float]:
    """The loss's seconds: detection, rendezvous (to the restarted rank's header), resume, their sum."""
    # The rank log's header is to the second: a rendezvous shorter than that reads as 0, not below.
    detection, rendezvous = detected_at - killed_at, max(0.0, alone_start - detected_at)
    resumed_alone = _first_step_after(records, alone_start) - (detected_at + rendezvous)
    return {
        "loss_detection_s": round(detection, 2),
        "loss_rendezvous_s": round(rendezvous, 2),
        "loss_resume_s": round(resumed_alone, 2),
        "loss_to_training_s": round(detection + rendezvous + resumed_alone, 2),
    }


def _packed(work: Path) -> Path:
    images = generate(work / "shapes", count=160, size=20, val_count=20, workers=1)
    pack(images, work / "packed", shard_bytes=20 * 1024, codec="raw", workers=1)
    return work / "packed"


def _samples(rows: list[dict[str, Any]], key: str) -> list[float] | None:
    values = [row[key] for row in rows if key in row]
    return values or None


def _loss_summary(rows: list[dict[str, Any]], reason: str, quick: bool) -> dict[str, dict[str, Any]]:
    def median(key: str) -> float | None:
        values = _samples(rows, key)
        return statistics.median(values) if values else None

    no_return = reason or ("--quick loses the host without its return" if quick and rows else "")
    return {
        "node_loss_to_training_s": goal(
            None, RECOVERY_GOAL_S, samples=_samples(rows, "loss_to_training_s"), reason=reason,
            detection_s=median("loss_detection_s"), rendezvous_s=median("loss_rendezvous_s"),
            resume_s=median("loss_resume_s"),
        ),
        "node_return_to_training_s": goal(
            None, RECOVERY_GOAL_S, samples=_samples(rows, "return_to_training_s"), reason=no_return,
            join_s=median("return_join_s"), resume_s=median("return_resume_s"),
        ),
    }  # fmt: skip


def _scaling_summary(
    rows: list[dict[str, Any]], plan: scaling.ScalingPlan | None, reason: str
) -> dict[str, dict[str, Any]]:
    q = plan.exchanges[0] if plan is not None else 0.0
    samples = scaling.efficiencies(rows, 4, q) if plan is not None and 4 in plan.sizes else []
    details: dict[str, Any] = {}
    if plan is not None and rows:
        predicted = scaling.predicted_efficiency(plan, 4 if samples else 2, q)
        measured = statistics.median(samples or scaling.efficiencies(rows, 2, q))
        details = {
            "exchange": q,
            "efficiency_2_hosts": statistics.median(scaling.efficiencies(rows, 2, q)),
            "planner_efficiency": round(predicted, 4),
            "vs_planner": round(measured / predicted, 4),
        }
        if 0.0 in plan.exchanges and samples:
            details["local_only_efficiency_4_hosts"] = statistics.median(scaling.efficiencies(rows, 4, 0.0))
    if not reason and not samples:
        reason = "--quick measures 1 and 2 hosts" if rows else NOT_MEASURED
    return {
        "weak_scaling_efficiency_4_hosts": goal(
            None, ">= 0.9", samples=samples or None, reason=reason, **details
        )
    }


def planner_errors(rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """|probed / measured - 1| of every cell of ``rows`` with a probe's prediction, scaling and strategy
    cells alike (measured: the median over its repeats), and per repeat the worst over the cells."""
    cells: dict[tuple[str, int, float, str], list[dict[str, Any]]] = {}
    for row in rows:
        if "probed_s" in row:
            key = (row["box"], row["hosts"], row["exchange"], row.get("strategy", ""))
            cells.setdefault(key, []).append(row)
    errors = [
        abs(runs[0]["probed_s"] / statistics.median(r["seconds"] for r in runs) - 1)
        for runs in cells.values()
    ]
    worst: dict[int, float] = {}
    for runs in cells.values():
        for r in runs:
            worst[r["repeat"]] = max(worst.get(r["repeat"], 0.0), abs(r["probed_s"] / r["seconds"] - 1))
    return [round(e, 4) for e in errors], [round(worst[k], 4) for k in sorted(worst)]


def _cell_names(rows: list[dict[str, Any]]) -> list[str]:
    """The cells in :func:`planner_errors`' order."""
    names = []
    for r in rows:
        if "probed_s" in r:
            what = r.get("strategy") or f"Q {r['exchange']:g}"
            names.append(f"{r['box']} box, {r['hosts']} hosts, {what}")
    return list(dict.fromkeys(names))


def _planner_summary(
    fitted: list[dict[str, Any]], unseen: list[dict[str, Any]], reason: str
) -> dict[str, dict[str, Any]]:
    """The model's error on the frozen unseen box (the goals) and, beside it, on the scaling box its terms
    were written against (named, never mixed in)."""
    errors, worst = planner_errors(unseen)
    fitted_errors, _ = planner_errors(fitted)
    if not reason and not errors:
        reason = "--quick runs no probe and no planner cells" if unseen or fitted else NOT_MEASURED
    return {
        "planner_unseen_median_abs_error": goal(
            None,
            "<= 0.15",
            samples=errors or None,
            unit="cells",
            reason=reason,
            cells=_cell_names(unseen),
            fitted_cells=_cell_names(fitted),
            fitted_errors=fitted_errors,
            fitted_median=round(statistics.median(fitted_errors), 4) if fitted_errors else None,
        ),
        "planner_unseen_worst_abs_error": goal(None, "<= 0.30", samples=worst or None, reason=reason),
    }


def _strategy_seconds(rows: list[dict[str, Any]], hosts: int) -> dict[str, dict[int, float]]:
    """Measured seconds of each strategy's cell at ``hosts`` hosts, per repeat."""
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        if row["hosts"] == hosts and "strategy" in row:
            out.setdefault(row["strategy"], {})[row["repeat"]] = row["seconds"]
    return out


def recommendation_vs_fastest(
    rows: list[dict[str, Any]], record: dict[str, Any] | None, reason: str, where: str = ""
) -> dict[str, Any]:
    """The goal entry ``planner_recommendation_vs_fastest_equal_quality``: the measured epoch of the
    planner's recommended strategy over that of the fastest measured strategy whose quality (the planner's
    column) is at least the recommended one's, per repeat (:data:`EQUAL_QUALITY_RULE`); every strategy's
    measured, predicted seconds and quality in ``strategies``. ``record``: :func:`scaling.strategy_plan`."""
    if record is None:
        return goal(
            None, RECOMMENDATION_GOAL, reason=reason or NOT_MEASURED, equal_quality_rule=EQUAL_QUALITY_RULE
        )
    table = {row["strategy"]: row for row in record["strategies"]}
    chosen = record["recommendation"]["strategy"]
    measured = _strategy_seconds(rows, record["nodes"])
    floor = table[chosen]["quality"]
    per_strategy = {
        name: {
            "measured_s": round(statistics.median(measured[name].values()), 3)
            if measured.get(name)
            else None,
            "samples_s": [measured.get(name, {})[r] for r in sorted(measured.get(name, {}))],
            "predicted_s": row["first_epoch_s"],
            "quality": row["quality"],
            "equal_quality": row["quality"] >= floor,
        }
        for name, row in table.items()
    }
    candidates = [name for name, entry in per_strategy.items() if entry["equal_quality"]]
    details: dict[str, Any] = {
        "recommended": chosen,
        "why": record["recommendation"]["why"],
        "planner": f"kaisoku plan --epochs {record['epochs']} --au {record['au_target']:g}, {record['nodes']} "
        f"nodes, cluster from {record['cluster']}",
        "cell": where,
        "equal_quality_rule": EQUAL_QUALITY_RULE,
        "strategies": per_strategy,
    }
    unmeasured = [name for name in candidates if per_strategy[name]["measured_s"] is None]
    if not reason and unmeasured:
        reason = f"no measured epoch of {', '.join(unmeasured)}"
    if not reason and len(candidates) < 2:
        reason = f"only {chosen} has quality >= {floor:g}: no strategy of equal quality to compare it with"
    samples = None
    if not reason:
        details["fastest_equal_quality"] = min(candidates, key=lambda name: per_strategy[name]["measured_s"])
        # Only repeats in which every candidate ran: a missing one could have been the fastest.
        complete = sorted(set.intersection(*(set(measured[name]) for name in candidates)))
        samples = [
            measured[chosen][r] / min(measured[name][r] for name in candidates) for r in complete
        ] or None
        details["fastest_per_repeat"] = [
            min(candidates, key=lambda name, r=r: measured[name][r]) for r in complete
        ]
        if samples is None:
            reason = f"the strategies of quality >= {floor:g} share no repeat"
    return goal(None, RECOMMENDATION_GOAL, samples=samples, reason=reason, **details)


def _judged_cell(plan: scaling.ScalingPlan) -> str:
    """Where the strategies ran, in words."""
    hosts = plan.strategy_hosts
    return (
        f"{hosts} hosts at {plan.rate_mbit:g} Mbit/s each, {hosts * plan.per_host} samples, one cold epoch "
        f"per strategy, {plan.repeats} repeat(s) with the cells' order rotated per repeat"
    )


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Lose a host (once with --quick, without its return; 3 times, regained), then weak scaling over 1,
    2 and 4 hosts (1 and 2 with --quick), the planner's box and every strategy it compares on 2 hosts (on
    the scaling box with --quick); the tables and ``cluster.json``."""
    repeats = 1 if quick else 3
    rows: list[dict[str, Any]] = []
    scaled: list[dict[str, Any]] = []
    unseen: list[dict[str, Any]] = []
    plan: scaling.ScalingPlan | None = None
    # The planner's table of the box whose cells include every strategy (the unseen box; --quick: the
    # scaling box, on its nominal links) and that box's rows and plan.
    judged: tuple[list[dict[str, Any]], dict[str, Any], scaling.ScalingPlan] | None = None
    reason = unavailable_reason() or ""
    scaling_reason = reason or sshfs_unavailable_reason() or ""
    planner_reason = scaling_reason
    if not reason:
        with tempfile.TemporaryDirectory(prefix="kaisoku-bench-cluster-") as tmp:
            work = Path(tmp)
            try:
                with ClusterBox(2, shared=_packed(work), link=Link(rate_mbit=500)) as box:
                    clocks = QUICK_CLOCKS if quick else ""
                    rows = [
                        loss_and_return(box, work, repeat, clocks, regain=not quick)
                        for repeat in range(repeats)
                    ]
            except (BoxUnavailable, RuntimeError, subprocess.TimeoutExpired) as error:
                reason = f"the box run failed: {error}"
                rows = []
            if not scaling_reason:
                try:
                    scaled, plan, _ = scaling.measure(scaling.plan_for(quick, work / "scaling"), timeout=600)
                    scaled = [{"box": "scaling", **row} for row in scaled]
                    if plan.strategy_hosts:
                        judged = (scaled, scaling.strategy_plan(plan, None), plan)
                except (BoxUnavailable, RuntimeError, subprocess.SubprocessError, OSError) as error:
                    scaling_reason = f"the scaling run failed: {error}"
                    scaled = []
            planner_reason = scaling_reason
            if not planner_reason and not quick:
                try:
                    unseen, unseen_box, profile = scaling.measure(
                        scaling.unseen_plan(work / "unseen"), timeout=600
                    )
                    unseen = [{"box": "unseen", **row} for row in unseen]
                    judged = (unseen, scaling.strategy_plan(unseen_box, profile), unseen_box)
                    far, _, _ = scaling.measure(scaling.unseen_far_plan(work / "unseen-far"), timeout=600)
                    unseen = unseen + [{"box": "unseen-far", **row} for row in far]  # judged keeps its rows
                except (BoxUnavailable, RuntimeError, subprocess.SubprocessError, OSError) as error:
                    planner_reason = f"the planner's box run failed: {error}"
    summary = {
        **_loss_summary(rows, reason, quick),
        **_scaling_summary(scaled, plan, scaling_reason),
        **_planner_summary(scaled, unseen, planner_reason),
        "planner_recommendation_vs_fastest_equal_quality": recommendation_vs_fastest(
            judged[0] if judged else [],
            judged[1] if judged else None,
            "" if judged else planner_reason,
            _judged_cell(judged[2]) if judged else "",
        ),
    }
    print_table("cluster: a host lost" + ("" if quick else " and regained") + " (seconds)", rows, {})
    title = "cluster: weak scaling and the planner's cells, one epoch of loading + exchange (seconds)"
    print_table(title, scaled + unseen, summary)
    loss_note = (
        "Node loss: 2 hosts (network namespaces, 500 Mbit/s links), one rank each, small-cnn on 160 16-px "
        "shapes, batch 8, checkpoint every 4 steps; kill -9 of every process of host 1; return: its "
        "launcher started again with the same command. "
        + (
            f"--quick: rendezvous clocks {QUICK_CLOCKS} (heartbeat s : misses : last call s), no return. "
            if quick
            else "torchrun c10d rendezvous with its default heartbeats (5 s, 3 missed) and a 5 s last call. "
        )
    )
    scaling_note = (
        "Weak scaling: each host stages its partition of a set of hosts x per_host samples over sshfs from "
        "a storage host through its own tbf-shaped link and exchanges Q of it over the same link; images "
        "stay encoded and no model runs (2 shared cores: the cells measure the I/O path, not compute). "
        "Efficiency = 1-host epoch / n-host epoch per repeat; planner = kaisoku plan's model on the box's "
        "links. Strategy cells (cell: strategy): the other strategies kaisoku plan compares at 2 hosts, "
        "each through the loader kaisoku train builds for it; the recommendation is judged against them. "
    )
    return write_result(
        "cluster",
        out_dir,
        summary,
        [{"part": "loss", **row} for row in rows] + [{"part": "scaling", **row} for row in scaled + unseen],
        quick=quick,
        notes=loss_note + scaling_note + "Medians over the repeats.",
        extra={"repeats": repeats, "hosts": 2, "scaling_plan": asdict(plan) if plan is not None else None},
    )
