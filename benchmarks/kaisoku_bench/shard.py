"""``kaisoku bench shard``: sharded data parallelism (FSDP2 per block) against DDP on 4 gloo ranks (CPU).

Every figure is a ratio taken in one run, timings as medians of interleaved rounds:

- memory: the largest ViT width (in parameters) whose training steps stay under a per-rank memory cap,
  fully sharded against DDP. Each case's peak is the rank's high-water resident set (``VmHWM``, reset
  through ``/proc/self/clear_refs`` before the case) above its resident set before the model is built,
  the largest over ranks. The sharded model is built on the meta device and materialised shard by
  shard, as a model too large for one rank must be; large allocations are returned to the system between
  cases (``mallopt``), so one case does not inherit another's peak;
- step time: kaisoku's sharded engine (:class:`~kaisoku.engine.sharded.ShardedStep` over
  :func:`~kaisoku.distributed.sharding.shard_model`) against a minimal hand-written ``fully_shard`` loop
  (one unit per encoder layer and the root, AdamW) on the same model and batches; against DDP recorded,
  with the time of the per-step all-gathers measured on their own;
- checkpoints: the sharded parallel save (:func:`~kaisoku.distributed.sharded_checkpoint.save_sharded`)
  against rank 0's ``torch.save`` (+ fsync) of the same state gathered whole; the sharded folder's load onto
  another layout (unsharded, every rank) recorded;
- exactness: fully sharded against DDP weights after 20 SGD steps, and sharded against unsharded LARS, each
  as its largest difference over the stated tolerance.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torchvision.models import VisionTransformer

from kaisoku.distributed.mesh import build_data_mesh
from kaisoku.distributed.sharded_checkpoint import load_sharded, save_sharded, sharded_state
from kaisoku.distributed.sharding import shard_model, shard_norm_reducer
from kaisoku.distributed.spawn import run_ranks
from kaisoku.engine.sharded import ShardedStep
from kaisoku.engine.step import Precision
from kaisoku.memory.measure import read_peak_bytes, read_rss_bytes, reset_peak
from kaisoku.optim.factory import param_groups
from kaisoku.optim.lars import LARS
from kaisoku_bench.common import (
    goal,
    interleaved,
    median_iqr,
    print_table,
    slowest_rank_seconds,
    write_result,
)

NAME = "shard"
WORLD_SIZE = 4
IMAGE, PATCH, CLASSES, BATCH_PER_RANK = 16, 4, 10, 4
#: Sharded vs DDP weights after 20 fp32 SGD steps (reduce-scatter vs all-reduce: another summation order).
DDP_ATOL = 1e-5
#: Sharded vs unsharded LARS after 20 steps (norms summed from shards: another fp32 reduction order).
LARS_ATOL = 1e-5


def settings(quick: bool) -> dict[str, Any]:
    """Cap and widths of the memory sweep, the step-time and save models, rounds, exactness steps."""
    if quick:
        return {
            "cap_mib": 24, "layers": 4, "widths": [32 * k for k in range(1, 11)],
            "step_width": 96, "step_steps": 2, "rounds": 3,
            "save_width": 128, "save_layers": 2, "save_rounds": 3, "exact_steps": 10,
        }  # fmt: skip
    return {
        "cap_mib": 512, "layers": 8, "widths": [32 * k for k in range(1, 49)],
        "step_width": 384, "step_steps": 5, "rounds": 7,
        "save_width": 1280, "save_layers": 10, "save_rounds": 3, "exact_steps": 20,
    }  # fmt: skip


def vit(width: int, layers: int) -> VisionTransformer:
    """A ViT on 16 px images, 4 px patches, ``width`` wide (a multiple of 4: 4 heads), MLP 4x, no dropout."""
    return VisionTransformer(
        image_size=IMAGE, patch_size=PATCH, num_layers=layers, num_heads=4,
        hidden_dim=width, mlp_dim=4 * width, num_classes=CLASSES,
    )  # fmt: skip


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of the global batch of step ``step`` (keyed by the step, not the layout)."""
    generator = torch.Generator().manual_seed(1000 + step)
    images = torch.randn(BATCH_PER_RANK * WORLD_SIZE, 3, IMAGE, IMAGE, generator=generator)
    labels = torch.randint(0, CLASSES, (BATCH_PER_RANK * WORLD_SIZE,), generator=generator)
    part = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return images[part], labels[part]


# ---------------------------------------------------------------------------------------------- memory

_LIBC = ctypes.CDLL("libc.so.6")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _release() -> None:
    gc.collect()
    _LIBC.malloc_trim(0)


def _sharded_on_meta(width: int, layers: int, mesh: Any) -> nn.Module:
    """A fully sharded ViT whose whole weights never exist on one rank: built on meta, then each rank's
    shards materialised (small random values: this model measures memory and time, not accuracy)."""
    with torch.device("meta"):
        model = vit(width, layers)
    shard_model(model, mesh, level="full", precision_mode="fp32")
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for parameter in model.parameters():
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            local.copy_(torch.randn(local.shape, generator=generator) * 0.02)
    return model


def _peak_mib(layout: str, width: int, layers: int, mesh: Any) -> float:
    """The largest over ranks of the resident-set peak of building ``layout`` and two AdamW steps."""
    _release()
    base = read_rss_bytes()
    reset_peak()  # the high-water mark restarts from here
    if layout == "full":
        model = _sharded_on_meta(width, layers, mesh)
    else:
        model = DistributedDataParallel(vit(width, layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        images, labels = batch(dist.get_rank(), step)
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.tensor([(read_peak_bytes() - base) / 2**20], dtype=torch.float64)
    del model, optimizer
    _release()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())


def _memory(plan: dict[str, Any], mesh: Any) -> dict[str, Any]:
    # Large blocks straight from and back to the system: a freed case leaves no resident heap behind.
    _LIBC.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, 64 * 1024)
    layouts = ("ddp", "full")
    for layout in layouts:  # warm-up: a process's first case pays one-time allocations that are no layout's
        _peak_mib(layout, plan["widths"][0], plan["layers"], mesh)
    cases: dict[str, list[dict[str, float]]] = {layout: [] for layout in layouts}
    for width in plan["widths"]:  # the layouts alternate, so neither is measured on a warmer process
        for layout in layouts:
            if cases[layout] and cases[layout][-1]["peak_mib"] > plan["cap_mib"]:
                continue
            cases[layout].append({"width": width, "peak_mib": _peak_mib(layout, width, plan["layers"], mesh)})
    result: dict[str, Any] = {}
    for layout in layouts:
        fits = [c for c in cases[layout] if c["peak_mib"] <= plan["cap_mib"]]
        largest = max((c["width"] for c in fits), default=0)
        result[layout] = {
            "cases": cases[layout],
            "largest_width": largest,
            "capped": len(fits) == len(plan["widths"]),
        }
    return result


def parameters(width: int, layers: int) -> int:
    """Parameters of :func:`vit` (built on meta: nothing allocated)."""
    if width == 0:
        return 0
    with torch.device("meta"):
        return sum(p.numel() for p in vit(width, layers).parameters())


# ------------------------------------------------------------------------------------------- step time


def _step_times(plan: dict[str, Any], mesh: Any) -> dict[str, Any]:
    width, layers, steps, rank = plan["step_width"], plan["layers"], plan["step_steps"], dist.get_rank()
    torch.manual_seed(0)
    engine_model = shard_model(vit(width, layers), mesh, level="full", precision_mode="fp32")
    engine_optimizer = torch.optim.AdamW(engine_model.parameters(), lr=1e-3)
    engine = ShardedStep(
        engine_model, engine_optimizer, LambdaLR(engine_optimizer, lambda _: 1.0),
        loss_fn=nn.functional.cross_entropy, precision=Precision("fp32", torch.device("cpu")),
    )  # fmt: skip
    minimal = vit(width, layers)
    for layer in minimal.encoder.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(minimal, mesh=mesh["dp_shard"])
    minimal_optimizer = torch.optim.AdamW(minimal.parameters(), lr=1e-3)
    ddp = DistributedDataParallel(vit(width, layers))
    ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def plain(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        def run() -> None:
            for step in range(steps):
                images, labels = batch(rank, step)
                optimizer.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(images), labels).backward()
                optimizer.step()

        return run

    def kaisoku() -> None:
        for step in range(steps):
            engine.train_step([batch(rank, step)])

    blocks = {
        "kaisoku": kaisoku,
        "minimal": plain(minimal, minimal_optimizer),
        "ddp": plain(ddp, ddp_optimizer),
    }
    for block in blocks.values():  # warm-up
        slowest_rank_seconds(block, steps)
    times = interleaved(
        {name: (lambda b=block: slowest_rank_seconds(b, steps)) for name, block in blocks.items()},
        plan["rounds"],
    )
    # What full sharding adds: every block's weights gathered twice a step (forward and backward).
    shard_numel = math.ceil(
        sum(p.numel() for p in minimal.parameters()) / WORLD_SIZE
    )  # padded, as FSDP2 pads
    local = torch.zeros(shard_numel)
    whole = torch.zeros(shard_numel * WORLD_SIZE)
    group = mesh.get_group("dp_shard")
    gather = [
        slowest_rank_seconds(lambda: dist.all_gather_single(whole, local, group=group), 1)
        for _ in range(plan["rounds"])
    ]
    return {"seconds": times, "allgather_s": gather}


# --------------------------------------------------------------------------------------------- saving


def _save_times(tmp: Path, plan: dict[str, Any], mesh: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    model = _sharded_on_meta(plan["save_width"], plan["save_layers"], mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    nn.functional.cross_entropy(model(batch(rank, 0)[0]), batch(rank, 0)[1]).backward()
    optimizer.step()
    model_state, optimizer_state = sharded_state(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    whole_model, whole_optimizer = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    whole = {"model": whole_model, "optimizer": whole_optimizer}
    count = iter(range(10**6))
    last: list[Path] = [tmp]

    def sharded() -> float:
        folder = tmp / f"sharded-{next(count)}"
        if rank == 0:
            folder.mkdir()
        dist.barrier()
        seconds = slowest_rank_seconds(lambda: save_sharded(state, folder), 1)
        last[0] = folder
        return seconds

    def rank0() -> float:
        def save() -> None:
            if rank == 0:
                with open(tmp / "whole.pt", "wb") as handle:
                    torch.save(whole, handle)
                    handle.flush()
                    os.fsync(handle.fileno())

        return slowest_rank_seconds(save, 1)

    times = interleaved({"sharded": sharded, "rank0": rank0}, plan["save_rounds"])
    numel = sum(p.numel() for p in whole_model.values())
    whole.clear()
    del whole_model, whole_optimizer
    # The sharded folder read onto another layout: an unsharded model and optimizer on every rank.
    plain = vit(plan["save_width"], plan["save_layers"])
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    load = slowest_rank_seconds(lambda: load_sharded(last[0], plain, plain_optimizer), 1)
    return {"seconds": times, "parameters": numel, "load_unsharded_s": load}


# ------------------------------------------------------------------------------------------ exactness


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _exactness(plan: dict[str, Any], mesh: Any) -> dict[str, float]:
    rank, steps = dist.get_rank(), plan["exact_steps"]
    torch.manual_seed(0)
    reference = vit(64, 2)
    ddp = DistributedDataParallel(_copy(reference))
    sharded = shard_model(_copy(reference), mesh, level="full", precision_mode="fp32")
    pairs = [(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))]
    pairs.append((sharded, torch.optim.SGD(sharded.parameters(), lr=0.05, momentum=0.9)))
    lars_whole = _copy(reference)
    lars_sharded = shard_model(_copy(reference), mesh, level="full", precision_mode="fp32")
    whole_optimizer = LARS(param_groups(lars_whole, weight_decay=1e-4), lr=0.5, momentum=0.9)
    sharded_optimizer = LARS(param_groups(lars_sharded, weight_decay=1e-4), lr=0.5, momentum=0.9)
    sharded_optimizer.reduce_norms_with(shard_norm_reducer(mesh))
    for step in range(steps):
        images, labels = batch(rank, step)
        for model, optimizer in pairs + [(lars_sharded, sharded_optimizer)]:
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        # The unsharded reference sees the whole global batch (the mean the shards' gradients reach).
        everything = [batch(r, step) for r in range(WORLD_SIZE)]
        whole_images = torch.cat([i for i, _ in everything])
        whole_labels = torch.cat([t for _, t in everything])
        nn.functional.cross_entropy(lars_whole(whole_images), whole_labels).backward()
        whole_optimizer.step()
        whole_optimizer.zero_grad(set_to_none=True)
    ddp_state = {k.removeprefix("module."): v for k, v in _whole(ddp).items()}
    return {
        "sharded_vs_ddp": _max_difference(ddp_state, _whole(sharded)),
        "lars_sharded_vs_whole": _max_difference(_whole(lars_whole), _whole(lars_sharded)),
    }


def _copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# ------------------------------------------------------------------------------------------------ run


def _rank_main(rank: int, world_size: int, tmp: Path, plan: dict[str, Any]) -> dict[str, Any]:
    mesh = build_data_mesh(1, world_size)
    # Memory first: the other parts leave the process's heap and caches larger than a fresh rank's.
    memory = _memory(plan, mesh)
    return {
        "memory": memory,
        "exact": _exactness(plan, mesh),
        "step": _step_times(plan, mesh),
        "save": _save_times(tmp, plan, mesh),
    }


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    """Measure on 4 gloo ranks and record ``shard.json``."""
    plan = settings(quick)
    with tempfile.TemporaryDirectory(prefix="kaisoku-bench-shard-") as tmp:
        results = run_ranks(
            _rank_main, WORLD_SIZE, Path(tmp), plan, timeout=3600.0, collective_timeout=600.0
        )[0]
    summary: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    memory = results["memory"]
    ddp_params, full_params = (
        parameters(memory[k]["largest_width"], plan["layers"]) for k in ("ddp", "full")
    )
    for layout in ("ddp", "full"):
        for case in memory[layout]["cases"]:
            rows.append(
                {
                    "figure": "memory",
                    "layout": layout,
                    **case,
                    "parameters": parameters(case["width"], plan["layers"]),
                }
            )
    reason = ""
    if not ddp_params:
        reason = f"DDP fits no width under {plan['cap_mib']} MiB: raise the cap"
    elif memory["full"]["capped"]:
        reason = "the sweep's widest case still fit fully sharded: widen the sweep"
    summary["largest_params_full_vs_ddp_at_4_ranks"] = goal(
        full_params / ddp_params if ddp_params else None, ">= 3.0", reason=reason,
        exact="a discrete sweep: the parameter counts of the widest width that fits each layout",
        cap_mib=plan["cap_mib"], ddp_width=memory["ddp"]["largest_width"], full_width=memory["full"]["largest_width"],
    )  # fmt: skip
    seconds = results["step"]["seconds"]
    ratios = [k / m for k, m in zip(seconds["kaisoku"], seconds["minimal"])]
    ratio, iqr = median_iqr(ratios)
    gather, _ = median_iqr(results["step"]["allgather_s"])
    ddp_ratio, _ = median_iqr([k / d for k, d in zip(seconds["kaisoku"], seconds["ddp"])])
    summary["step_time_vs_minimal_fully_shard"] = goal(
        ratio, "<= 1.03", samples=ratios, unit="rounds", iqr=round(iqr, 4)
    )
    for name, values in seconds.items():
        rows.append(
            {
                "figure": "step",
                "side": name,
                "seconds_per_step": median_iqr(values)[0],
                "width": plan["step_width"],
            }
        )
    rows.append(
        {"figure": "step", "side": "sharded_vs_ddp", "ratio": ddp_ratio, "allgather_s_per_step": 2 * gather}
    )
    save = results["save"]["seconds"]
    save_ratios = [s / r for s, r in zip(save["sharded"], save["rank0"])]
    save_ratio, save_iqr = median_iqr(save_ratios)
    summary["sharded_save_vs_rank0_torch_save"] = goal(
        save_ratio, "<= 0.5", samples=save_ratios, unit="rounds", iqr=round(save_iqr, 4),
        parameters=results["save"]["parameters"],
        reason="" if not quick else "quick: a small model, not ~200M parameters",
    )  # fmt: skip
    rows.append(
        {
            "figure": "save",
            **{f"{k}_s": median_iqr(v)[0] for k, v in save.items()},
            "load_unsharded_s": results["save"]["load_unsharded_s"],
            "parameters": results["save"]["parameters"],
        }
    )
    exact = results["exact"]
    # As ratios to the stated tolerances (the differences themselves are far below the record's rounding).
    for figure, key, tolerance in (
        ("sharded_vs_ddp_weight_diff_over_tolerance", "sharded_vs_ddp", DDP_ATOL),
        ("lars_sharded_vs_unsharded_diff_over_tolerance", "lars_sharded_vs_whole", LARS_ATOL),
    ):
        summary[figure] = goal(
            exact[key] / tolerance, "<= 1.0", max_abs_diff=exact[key], tolerance=tolerance,
            exact="the largest difference after the same seeded steps: no timing noise",
        )  # fmt: skip
    notes = (
        f"{WORLD_SIZE} gloo ranks x 1 thread on CPU; ViT at {IMAGE} px, patch {PATCH}, {BATCH_PER_RANK} images per "
        f"rank; memory: peak resident set above the pre-build one, cap {plan['cap_mib']} MiB, AdamW; step: width "
        f"{plan['step_width']}, {plan['rounds']} interleaved rounds; save: width {plan['save_width']} x "
        f"{plan['save_layers']} layers with AdamW state; exactness: SGD and LARS, {plan['exact_steps']} steps."
    )
    record = write_result(NAME, out_dir, summary, rows, quick=quick, notes=notes)
    print_table(f"kaisoku bench {NAME}", rows, summary)
    return record
