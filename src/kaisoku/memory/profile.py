"""Profile one step per block for the budget planner, and set a run's memory techniques up from config.

:func:`profile_step` runs the bare model on one batch of the run's shape and measures, per block
of :func:`~kaisoku.models.blocks.ordered_blocks`: the bytes it saves for backward, its forward time (what
recomputing it costs), what its saved tensors take compressed and how long compression takes, its
compression error, and what offload would leave and cost. The plain step's peak (VmHWM on the CPU,
``max_memory_allocated`` on CUDA) calibrates the part of the peak no technique changes. The model's
weights, buffers and the RNG come back as they were: profiling changes nothing in the run.

:func:`setup_memory` is what ``kaisoku train`` calls: global ``memory.recompute`` / ``compress`` /
``offload``, or with ``memory.budget`` / ``memory.policy`` the per-block plan, applied through
:func:`~kaisoku.memory.checkpointing.apply_techniques`. Under data parallelism every rank profiles, and
every rank then applies rank 0's plan (its ``agree`` callable): the plan the log shows is what each rank
does. Over several ranks the budget may be met by full sharding instead, priced from the profile and a
measured all-gather and reduce-scatter of the weights (the choice is rank 0's too).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kaisoku.errors import ConfigError
from kaisoku.memory.checkpointing import apply_recompute, apply_techniques
from kaisoku.memory.compress import ActivationCompressor, _compressible
from kaisoku.memory.measure import read_peak_bytes, read_rss_bytes, reset_peak
from kaisoku.memory.offload import (
    MAX_PENDING,
    DiskOffload,
    PinnedOffload,
    _offloadable,
    build_offload,
    check_offload_dir,
)
from kaisoku.memory.planner import (
    BlockCost,
    Option,
    Plan,
    choose_with_shard,
    minimum_peak,
    parse_budget,
    parse_policy,
    policy_plan,
    price_shard,
)
from kaisoku.models.blocks import ordered_blocks
from kaisoku.units import format_bytes

#: Fraction of memory.budget the planner leaves free for what its model of the peak does not see.
HEADROOM = 0.10
#: Compression whose relative error (L2, worst saved tensor of the block) exceeds this is not offered to
#: the planner for that block.
MAX_COMPRESS_ERROR = {"bf16": 0.01, "int8": 0.05}
#: Tests only: when set, :func:`setup_memory` plans from ``_adjust_profile(profile)`` (a seam that makes
#: one rank's measurements differ from another's without touching the collective).
_adjust_profile: Callable[[Profile], Profile] | None = None


@dataclass
class _Tally:
    """What one block's saved tensors add up to."""

    saved: int = 0
    not_offloadable: int = 0
    offloadable: int = 0
    largest: int = 0
    largest_compressible: int = 0
    compressed: dict[str, int] = field(default_factory=lambda: {"bf16": 0, "int8": 0})
    error: dict[str, float] = field(default_factory=lambda: {"bf16": 0.0, "int8": 0.0})
    compress_s: dict[str, float] = field(default_factory=lambda: {"bf16": 0.0, "int8": 0.0})


@dataclass(frozen=True)
class Profile:
    """Per-block costs and the calibration of one profiled step."""

    blocks: list[BlockCost]
    """One :class:`BlockCost` per block."""
    fixed: int
    """Bytes of a step's peak that no technique changes (plain rise minus the saved activations)."""
    plain_peak: int
    """Measured peak of the plain step above the memory held when it began (bytes)."""
    source: str
    """How the peak was measured."""
    backward_bytes: int = 0
    """Gradient bytes that exist alongside a block brought back late in backward."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Other figures for the log."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bandwidth(offload: str, device: torch.device, directory: str) -> float:
    """Bytes per second of one round trip (out, flushed, back) of a 16 MiB tensor through the offload."""
    store = build_offload(offload, device, directory)
    assert store is not None
    try:
        best = math.inf
        for _ in range(2):
            store.begin()
            probe = torch.ones(4 << 20, device=device)
            start = time.perf_counter()
            handle = store._pack(probe)
            store.flush()
            store._unpack(handle)
            _sync(device)
            best = min(best, time.perf_counter() - start)
        return (4 << 20) * 4 / max(best, 1e-9)
    finally:
        store.close()


def profile_step(
    model: nn.Module,
    *,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    compress: str = "bf16",
    offload: str = "none",
    offload_dir: str = "",
    update_in_backward: bool = False,
    read_ahead: int = 4,
) -> Profile:
    """Profile one step of ``model`` (bare, not yet wrapped) on ``batch`` (inputs, targets) of the run's shape.

    Two steps: one with the saved tensors counted (and a warm-up), one plain, timed per block and
    measured (peak above the memory held when it began). ``offload``: none, disk or pinned (what the
    planner may use); ``update_in_backward``: gradients are freed as they are used, so the fixed part
    holds one parameter's gradient rather than all of them.
    """
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    blocks = ordered_blocks(model)
    saved_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    was_training = model.training
    images, labels = (t.to(device) for t in batch)
    times = [0.0] * len(blocks)
    tallies = [_Tally() for _ in blocks]
    inputs = [0] * len(blocks)
    outputs = [0] * len(blocks)
    compressors = {mode: ActivationCompressor(mode) for mode in ("bf16", "int8")}  # type: ignore[arg-type]
    model.train()

    # A saved weight is often a view of the parameter (a Linear's transposed weight), not a new tensor.
    weight_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def count(tally: _Tally, seen: dict[int, Any], t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in weight_storages:
            return t
        if id(t) in seen and seen[id(t)]() is t:
            # Saved again by another operation: kept once as it is, but compressed once per save.
            if _compressible(t):
                for mode in compressors:
                    tally.compressed[mode] += t.numel() * (2 if mode == "bf16" else 1)
            return t
        seen[id(t)] = weakref.ref(t)  # a tensor saved by two operations counts once
        size = t.numel() * t.element_size()
        tally.saved += size
        tally.largest = max(tally.largest, size)
        if _offloadable(t):
            tally.offloadable += size
        else:
            tally.not_offloadable += size
        if not _compressible(t):
            for mode in compressors:
                tally.compressed[mode] += size
            return t
        tally.largest_compressible = max(tally.largest_compressible, size)
        ref = t.detach().float()
        for mode, compressor in compressors.items():
            start = time.perf_counter()
            back = compressor._unpack(compressor._pack(t.detach()))
            _sync(device)
            tally.compress_s[mode] += time.perf_counter() - start
            error = float((back.float() - ref).norm() / ref.norm().clamp(min=1e-12))
            tally.error[mode] = max(tally.error[mode], error)
            tally.compressed[mode] += t.numel() * (2 if mode == "bf16" else 1)
        return t

    def run(hooked: bool) -> None:
        x = images
        with autocast():
            for index, block in enumerate(blocks):
                inputs[index] = x.numel() * x.element_size()
                pack = functools.partial(count, tallies[index], {})
                hooks = (
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
                    if hooked
                    else contextlib.nullcontext()
                )
                _sync(device)
                start = time.perf_counter()
                with hooks:
                    x = block(x)
                outputs[index] = x.numel() * x.element_size()
                _sync(device)
                times[index] = time.perf_counter() - start
            loss = loss_fn(x, labels)
        loss.backward()
        model.zero_grad(set_to_none=True)

    try:
        run(hooked=True)  # also the warm-up: first-touch allocations, kernels
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            run(hooked=False)
            peak, source = torch.cuda.max_memory_allocated(device), "cuda.max_memory_allocated"
        else:
            reset_peak()
            before = read_rss_bytes()
            run(hooked=False)
            peak, source = read_peak_bytes(), "VmHWM"
        bandwidth = _bandwidth(offload, device, offload_dir) if offload != "none" else 0.0
    finally:
        with torch.no_grad():
            for key, value in model.state_dict().items():
                value.copy_(saved_state[key])
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.train(was_training)
    grads = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
    largest_param = max((p.numel() * p.element_size() for p in model.parameters()), default=0)
    costs = []
    for index, tally in enumerate(tallies):
        saved = tally.saved
        # Its backward works with the gradients that exist by then (every block's from here on; one
        # parameter's with the update in backward) and its gradient tensors: the one flowing in (its
        # output's size) and the largest it makes (about its largest saved tensor).
        late = largest_param if update_in_backward else sum(grads[index:])
        options = {
            "keep": Option(saved, 0.0),
            "recompute": Option(min(saved, inputs[index]), times[index], transient_bytes=saved),
        }
        for mode, name in ((compress, "compress"), ("int8", "int8")):
            if name == "int8" and compress == "int8":
                continue  # the same as compress
            if tally.error[mode] <= MAX_COMPRESS_ERROR[mode] and tally.compressed[mode] < saved:
                options[name] = Option(
                    tally.compressed[mode], tally.compress_s[mode], transient_bytes=tally.largest_compressible
                )
        if bandwidth > 0 and tally.offloadable > 0:
            # Read-ahead window coming back, plus what waits for the writer during the forward pass.
            window = min(tally.offloadable, (read_ahead + 1) * tally.largest + MAX_PENDING)
            options["offload"] = Option(tally.not_offloadable, tally.offloadable / bandwidth, window)
        costs.append(
            BlockCost(
                saved_bytes=saved,
                options=options,
                compress_error=tally.error[compress],
                backward_bytes=late + tally.largest + outputs[index],
                param_bytes=grads[index],
            )
        )
    rise = max(0, int(peak) - int(before))
    total_saved = sum(t.saved for t in tallies)
    # Calibration: the part no plan changes is what the measured plain step shows beyond the model of
    # plain (every block kept), at the phase where that model peaks.
    modelled = minimum_peak(costs, 0, dict.fromkeys(range(len(costs)), "keep"))
    fixed = max(0, rise - modelled)
    notes = {"param_bytes": sum(grads), "saved_bytes": total_saved, "offload_bytes_per_s": bandwidth}
    return Profile(blocks=costs, fixed=fixed, plain_peak=rise, source=source, backward_bytes=0, notes=notes)


@dataclass
class MemorySetup:
    """What :func:`setup_memory` did: the global hooks for the engine, the plan, the offload store."""

    activations: Any = None
    """A context provider (``.step()``) for the engine's forward pass, or None."""
    plan: Plan | None = None
    """The per-block plan (memory.budget / memory.policy), or None."""
    offload: DiskOffload | PinnedOffload | None = None
    """The offload store in use (closed at the end of the run), or None."""
    profile: Profile | None = None
    """The profile the plan was chosen from (memory.budget only; rank 0's is the one the plan comes from)."""
    ranks: int = 1
    """Ranks that apply this same plan (every rank of the run)."""

    def record(self) -> dict[str, Any]:
        """The plan as a ``metrics.jsonl`` event (empty when there is none)."""
        if self.plan is None:
            return {}
        record: dict[str, Any] = {
            "event": "memory_plan",
            "plan": self.plan.summary(),
            "techniques": list(self.plan.techniques),
            "budget_bytes": self.plan.budget,
            "predicted_peak_bytes": self.plan.predicted_peak,
            "added_s": round(self.plan.added_s, 6),
            "shared_by_ranks": self.ranks,
        }
        if self.plan.budget:
            record["shard"] = self.plan.shard
            record["shard_note"] = self.plan.shard_note
        price = self.plan.shard_price
        if price is not None:
            record["shard_priced"] = {
                "shards": price.shards,
                "predicted_peak_bytes": price.predicted_peak,
                "added_s": round(price.added_s, 6),
                "weight_bytes_saved": price.weight_bytes_saved,
            }
        if self.profile is not None:
            record["plain_peak_bytes"] = self.profile.plain_peak
            record["fixed_bytes"] = self.profile.fixed
            record["compress_error"] = [round(b.compress_error, 6) for b in self.profile.blocks]
        return record

    def message(self) -> str:
        """The plan in one log line."""
        if self.plan is None:
            return ""
        budget = f" for memory.budget {format_bytes(self.plan.budget)}" if self.plan.budget else ""
        shared = f", rank 0's plan shared by all {self.ranks} ranks" if self.ranks > 1 else ""
        what = self.plan.summary()
        if self.plan.shard != "none":
            what += f" over {self.ranks} ranks, no activation techniques"
        note = f"; {self.plan.shard_note}" if self.plan.shard_note and self.plan.shard == "none" else ""
        return (
            f"memory plan{budget}: {what} (predicted peak "
            f"{format_bytes(self.plan.predicted_peak)}, +{self.plan.added_s * 1000:.1f} ms per step{shared}){note}"
        )


def setup_memory(
    model: nn.Module,
    memory: Any,
    *,
    device: torch.device,
    example: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    agree: Callable[[Any], Any] | None = None,
    ranks: int = 1,
    shard_ranks: int = 0,
    gather_time: Callable[[int], float] | None = None,
    not_priced: str = "",
) -> MemorySetup:
    """Apply ``memory`` (a :class:`~kaisoku.config_sections.MemoryConfig`) to the bare ``model``.

    ``example`` gives one batch of the run's shape (inputs, targets); it is called only when memory.budget
    profiles a step.

    ``agree``: under data parallelism, a collective that returns rank 0's value on every rank
    (:func:`kaisoku.distributed.env.rank_zero_value`); every rank calls it once with memory.budget, and
    applies the plan it returns. None on a single rank. ``ranks``: the number of ranks, for the log.

    ``shard_ranks`` >= 2 with ``gather_time``: memory.budget also prices full sharding over that many
    ranks; ``gather_time(numel)`` is the collective that times one all-gather plus reduce-scatter of
    ``numel`` fp32 values (every rank calls it once). A plan that chooses it (``plan.shard == "full"``)
    applies no technique to the model: the caller builds the sharded engine. Otherwise ``not_priced`` says
    why sharding was not priced, for the log.
    """
    setup = MemorySetup(ranks=ranks)
    offload_mode = memory.offload
    planned = bool(memory.budget or memory.policy.strip())
    if offload_mode == "none" and planned and (memory.offload_dir or device.type == "cuda"):
        # The planner may offload: to the directory given, else (CUDA) to pinned host memory.
        offload_mode = "disk" if memory.offload_dir else "pinned"
    if offload_mode == "disk":
        check_offload_dir(memory.offload_dir or "")
    if not planned:
        if memory.recompute != "none":
            apply_recompute(model, memory.recompute, memory.blocks)
        if memory.compress != "none":
            setup.activations = ActivationCompressor(memory.compress)
        elif offload_mode != "none":
            setup.offload = build_offload(offload_mode, device, memory.offload_dir)
            setup.activations = setup.offload
        return setup
    count = len(ordered_blocks(model))
    forced = parse_policy(memory.policy, count)
    compress = memory.compress if memory.compress != "none" else "bf16"
    if memory.budget:
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        budget = parse_budget(memory.budget, total)
        profile = profile_step(
            model,
            batch=example(),
            device=device,
            loss_fn=loss_fn,
            autocast=autocast,
            compress=compress,
            offload=offload_mode,
            offload_dir=memory.offload_dir,
            update_in_backward=memory.update_in_backward,
        )
        if _adjust_profile is not None:
            profile = _adjust_profile(profile)
        setup.profile = profile
        price = None
        if shard_ranks >= 2 and gather_time is not None:
            numel = sum(p.numel() for p in model.parameters())
            price = price_shard(
                profile.blocks,
                fixed=profile.fixed,
                shards=shard_ranks,
                gather_s=gather_time(numel),
                backward_bytes=profile.backward_bytes,
            )
        outcome: Plan | str
        try:
            outcome = choose_with_shard(
                profile.blocks,
                fixed=profile.fixed,
                budget=budget,
                shard=price,
                not_priced=not_priced,
                forced=forced,
                headroom=HEADROOM,
                backward_bytes=profile.backward_bytes,
            )
        except ConfigError as error:
            outcome = str(error)  # raised after agreeing, on every rank alike: no rank waits for one gone
        if agree is not None:
            # The profile holds measured times, so each rank could pick a different plan (and compression
            # is inexact). Rank 0's plan goes to every rank: the ranks are replicas (same model, same batch
            # per rank), their profiles differ by timing noise only, and rank 0's plan is the one logged.
            # (Max-reducing the profiles instead would log figures no rank measured.)
            outcome = agree(outcome)
        if isinstance(outcome, str):
            raise ConfigError(outcome)
        setup.plan = outcome
    else:
        setup.plan = Plan(techniques=policy_plan(count, forced), predicted_peak=0, added_s=0.0, budget=0)
    if setup.plan.shard != "none":
        return setup  # the sharded engine replaces the activation techniques
    if "offload" in setup.plan.techniques:
        setup.offload = build_offload(offload_mode, device, memory.offload_dir)
    apply_techniques(model, setup.plan.techniques, compress=compress, offload=setup.offload)
    return setup
