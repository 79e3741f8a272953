"""The memory budget planner: per block, keep / compress / recompute / offload, the cheapest plan that fits.

A profile of one step (:mod:`kaisoku.memory.profile`) gives, per block of
:func:`kaisoku.models.blocks.ordered_blocks`, a :class:`BlockCost`: the bytes the block keeps for backward,
what each technique leaves held, what it brings back at once during the block's backward, and the time
it adds. The peak of a step is modelled phase by phase:

    end of forward:        fixed + sum(held of every block)
    backward of block k:   fixed + sum(held of blocks 0..k) + transient_k + backward_k

where ``peak`` is what a step adds to the memory held between steps (weights and optimizer state are
not part of it, as they are not of a budget), ``fixed`` is what a plan does not change (calibrated by
the profile's measured plain step), the blocks after k have been freed by the time block k's backward
runs, ``transient_k`` is what the technique brings back at once (a recomputed block's activations, an
offload's read-ahead window, one decompressed tensor) and ``backward_k`` what the backward pass of
block k works with besides (the gradients that exist by then, its gradient tensors in and out).
:func:`choose` minimises the added time under ``peak <= budget`` exactly: a Pareto frontier of
(bytes held so far, seconds) over the blocks in order, dropping a partial plan as soon as one phase
exceeds the budget. Everything here is pure (no torch), unit-tested on hand-worked cases.

Over several data-parallel ranks the planner also prices full sharding (:func:`price_shard`): the same
phases with every block kept, each gradient held as a 1/N shard once reduce-scattered (a block's own
gradient whole until then) and one block's weights gathered; its time is a measured all-gather plus
reduce-scatter of the weights. :func:`choose_with_shard` takes it when it fits and adds less time than the
cheapest per-block plan that fits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kaisoku.errors import ConfigError
from kaisoku.memory.offload import check_offload_dir
from kaisoku.units import format_bytes, parse_bytes

TECHNIQUES = ("keep", "compress", "int8", "recompute", "offload")
"""What the planner (or ``memory.policy``) can do with one block's saved activations: keep them,
compress them (``memory.compress``'s mode, bf16 by default), compress them to int8, recompute them,
offload them."""


@dataclass(frozen=True)
class Option:
    """One technique on one block: bytes held from forward to backward, seconds it adds to a step."""

    held_bytes: int
    """Bytes the block holds between its forward and its backward with this technique."""
    added_s: float
    """Seconds this technique adds to a step (0 for keep)."""
    transient_bytes: int = 0
    """Bytes it brings back at once during the block's backward (recomputed activations, read-ahead,
    a decompressed tensor)."""


@dataclass(frozen=True)
class BlockCost:
    """What the profile measured for one block."""

    saved_bytes: int
    """Bytes the block keeps for backward as it is (keep)."""
    options: Mapping[str, Option]
    """Technique -> its cost; a technique missing here is not available for this block."""
    compress_error: float = 0.0
    """Relative error (L2) of the compressed saved tensors, for the log."""
    backward_bytes: int = 0
    """What the block's backward works with besides its saved tensors: the gradients that exist by
    then and its gradient tensors in and out."""
    param_bytes: int = 0
    """Bytes of the block's parameters (as much again for their gradients)."""


@dataclass(frozen=True)
class ShardPrice:
    """What full sharding (``parallel.shard full``, every block kept) would give a step."""

    shards: int
    """Ranks the weights, gradients and optimizer state would be spread over."""
    predicted_peak: int
    """Modelled peak of a step, in bytes (the same measure as a per-block plan's)."""
    added_s: float
    """Seconds it adds to a step: the measured all-gather plus reduce-scatter of every parameter."""
    weight_bytes_saved: int = 0
    """Bytes of weights each rank no longer holds between steps (its optimizer state shrinks alike);
    outside the budget, which counts what a step adds."""


@dataclass(frozen=True)
class Plan:
    """The chosen technique per block and what the model predicts for it."""

    techniques: tuple[str, ...]
    """Technique per block, in block order."""
    predicted_peak: int
    """Modelled peak of a step with this plan, in bytes."""
    added_s: float
    """Modelled seconds the plan adds to a step."""
    budget: int
    """The budget it was chosen for, in bytes."""
    notes: dict[str, object] = field(default_factory=dict)
    """Profile figures kept for the log (plain peak, fixed bytes, ...)."""
    shard: str = "none"
    """``full`` when the plan is full sharding (no activation techniques), else ``none``."""
    shard_price: ShardPrice | None = None
    """What full sharding was priced at, where it was priced."""
    shard_note: str = ""
    """Why full sharding was chosen, not chosen, or not priced (one phrase for the log)."""

    def summary(self) -> str:
        """The plan in one line: ranges of blocks per technique, or the shard level."""
        if self.shard != "none":
            return f"shard {self.shard}"
        return ", ".join(f"{spec}:{tech}" for spec, tech in _ranges(self.techniques)) or "nothing"


def _ranges(techniques: Sequence[str]) -> list[tuple[str, str]]:
    """``["keep","keep","recompute"]`` -> ``[("0-1","keep"),("2","recompute")]``."""
    out: list[tuple[str, str]] = []
    start = 0
    for index in range(1, len(techniques) + 1):
        if index == len(techniques) or techniques[index] != techniques[start]:
            spec = str(start) if index - 1 == start else f"{start}-{index - 1}"
            out.append((spec, techniques[start]))
            start = index
    return out


_Item = tuple[int, float, tuple[str, ...], int]  # (held so far, seconds, choice, peak so far)


def _phase(block: BlockCost, option: Option, held_before: int, fixed: int, extra: int) -> int:
    """Modelled memory during ``block``'s backward with ``option`` after ``held_before`` bytes."""
    return fixed + held_before + option.held_bytes + option.transient_bytes + block.backward_bytes + extra


def _allowed(blocks: Sequence[BlockCost], forced: Mapping[int, str]) -> list[list[str]]:
    out = []
    for index, block in enumerate(blocks):
        names = [forced[index]] if index in forced else list(block.options)
        out.append([n for n in names if n in block.options])
    if not all(out):
        raise ConfigError("memory.policy leaves no technique available for some block")
    return out


def _plans(
    blocks: Sequence[BlockCost], allowed: Sequence[Sequence[str]], fixed: int, extra: int, room: int | None
) -> list[_Item]:
    """Plans over ``blocks`` whose every phase fits ``room`` (None: no limit), Pareto-pruned.

    With a room: the frontier of (held, seconds), the fastest for their held bytes (exact: the phases
    still to come depend on the held bytes alone). Without: the frontier of (held, peak so far), for
    the lowest peak of any plan.
    """
    front: list[_Item] = [(0, 0.0, (), 0)]
    for block, names in zip(blocks, allowed):
        merged: list[_Item] = []
        for held, added, choice, peak in front:
            for name in names:
                option = block.options[name]
                phase = _phase(block, option, held, fixed, extra)
                if room is not None and phase > room:
                    continue
                item = (held + option.held_bytes, added + option.added_s, choice + (name,), max(peak, phase))
                merged.append(item)
        second = 1 if room is not None else 3  # what a bigger held must beat: seconds, or the peak
        merged.sort(key=lambda item: (item[0], item[second]))
        front = []
        for item in merged:
            if not front or item[second] < front[-1][second]:
                front.append(item)
    return [(h, a, c, max(p, fixed + h)) for h, a, c, p in front if room is None or fixed + h <= room]


def minimum_plan(
    blocks: Sequence[BlockCost],
    fixed: int,
    forced: Mapping[int, str] | None = None,
    backward_bytes: int = 0,
) -> tuple[int, tuple[str, ...]]:
    """The lowest modelled peak of any plan, and that plan (what "needs at least" reports)."""
    plans = _plans(blocks, _allowed(blocks, forced or {}), fixed, backward_bytes, None)
    best = min(plans, key=lambda item: (item[3], item[1]))
    return best[3], best[2]


def minimum_peak(
    blocks: Sequence[BlockCost],
    fixed: int,
    forced: Mapping[int, str] | None = None,
    backward_bytes: int = 0,
) -> int:
    """The lowest modelled peak of any plan."""
    return minimum_plan(blocks, fixed, forced, backward_bytes)[0]


def choose(
    blocks: Sequence[BlockCost],
    *,
    fixed: int,
    budget: int,
    forced: Mapping[int, str] | None = None,
    headroom: float = 0.0,
    backward_bytes: int = 0,
) -> Plan:
    """The plan with the least added time whose modelled peak fits ``budget``.

    ``forced``: block index -> technique (``memory.policy``); ``headroom``: the fraction of the budget
    kept free for what the model does not see (allocator rounding, fragmentation);
    ``backward_bytes``: added to every block's own ``backward_bytes`` (what exists during any block's
    backward). Raises :class:`ConfigError` (one line, with the minimum) when no plan fits.
    """
    forced = dict(forced or {})
    for index, name in forced.items():
        if name not in blocks[index].options:
            raise ConfigError(f"memory.policy: {name} is not available for block {index} on this run")
    allowed = _allowed(blocks, forced)
    room = int(budget * (1 - headroom))
    fitting = _plans(blocks, allowed, fixed, backward_bytes, room)
    if not fitting:
        least, plan = minimum_plan(blocks, fixed, forced, backward_bytes)
        if headroom < 1:  # the budget that leaves the headroom free above that peak
            least = max(least, math.ceil(least / (1 - headroom)))
        summary = ", ".join(f"{spec}:{tech}" for spec, tech in _ranges(plan))
        raise ConfigError(
            f"memory.budget {format_bytes(budget)} is too small: this model needs at least "
            f"{format_bytes(least)} with its least-memory plan ({summary})"
        )
    held, added, choice, peak = min(fitting, key=lambda item: (item[1], item[3]))
    return Plan(techniques=choice, predicted_peak=peak, added_s=added, budget=budget)


def price_shard(
    blocks: Sequence[BlockCost], *, fixed: int, shards: int, gather_s: float, backward_bytes: int = 0
) -> ShardPrice:
    """Full sharding over ``shards`` ranks with every block kept: its modelled peak and added time.

    Each block's ``backward_bytes`` counts the gradients of it and the blocks after it whole (a profile
    without update-in-backward); sharded, they are 1/``shards`` each once reduce-scattered, except the
    block's own, whole until its reduce-scatter. One block's weights are gathered at a time (the largest
    counted in every phase). ``gather_s``: the measured time of one all-gather and one reduce-scatter of
    every parameter, what full sharding adds to a step over DDP (a conservative price: DDP's all-reduce
    does about as much, and the gathers overlap compute).
    """
    if shards < 2:
        raise ValueError(f"full sharding needs at least 2 ranks, got {shards}")
    gathered = max((block.param_bytes for block in blocks), default=0)
    sharded = []
    for index, block in enumerate(blocks):
        late = sum(b.param_bytes for b in blocks[index:])
        own = math.ceil((late - block.param_bytes) / shards) + block.param_bytes
        keep = block.options["keep"]
        sharded.append(
            BlockCost(
                block.saved_bytes, {"keep": keep}, backward_bytes=max(0, block.backward_bytes - late + own)
            )
        )
    peak = minimum_peak(sharded, fixed, backward_bytes=backward_bytes + gathered)
    end_of_forward = fixed + sum(block.options["keep"].held_bytes for block in blocks) + gathered
    weights = sum(block.param_bytes for block in blocks)
    return ShardPrice(
        shards=shards,
        predicted_peak=max(peak, end_of_forward),
        added_s=gather_s,
        weight_bytes_saved=weights - math.ceil(weights / shards),
    )


def choose_with_shard(
    blocks: Sequence[BlockCost],
    *,
    fixed: int,
    budget: int,
    shard: ShardPrice | None,
    not_priced: str = "",
    forced: Mapping[int, str] | None = None,
    headroom: float = 0.0,
    backward_bytes: int = 0,
) -> Plan:
    """:func:`choose`, or full sharding (``shard``, priced by :func:`price_shard`) where it fits the budget
    and adds less time than the cheapest per-block plan that fits (or none fits).

    ``shard`` None: sharding was not priced, for the reason ``not_priced`` (kept in the plan's note).
    Raises :class:`ConfigError` (one line) when neither fits, with what sharding would need.
    """
    room = int(budget * (1 - headroom))
    try:
        per_block: Plan | None = choose(
            blocks,
            fixed=fixed,
            budget=budget,
            forced=forced,
            headroom=headroom,
            backward_bytes=backward_bytes,
        )
        failure = ""
    except ConfigError as error:
        per_block, failure = None, str(error)
    if shard is None:
        if per_block is None:
            raise ConfigError(failure)
        return replace(per_block, shard_note=f"sharding not priced: {not_priced}" if not_priced else "")
    words = f"full sharding over {shard.shards} ranks"
    fits = shard.predicted_peak <= room
    if fits and (per_block is None or shard.added_s < per_block.added_s):
        than = (
            "no per-block plan fits"
            if per_block is None
            else f"the cheapest per-block plan adds +{per_block.added_s * 1000:.1f} ms"
        )
        return Plan(
            techniques=("keep",) * len(blocks),
            predicted_peak=shard.predicted_peak,
            added_s=shard.added_s,
            budget=budget,
            shard="full",
            shard_price=shard,
            shard_note=f"{words} chosen: it fits and {than}",
        )
    # The budget that leaves the headroom free above sharding's peak.
    needs = format_bytes(
        math.ceil(shard.predicted_peak / (1 - headroom)) if headroom < 1 else shard.predicted_peak
    )
    if per_block is None:
        raise ConfigError(f"{failure}; {words} needs at least {needs}")
    why = (
        f"it needs at least {needs}"
        if not fits
        else f"it adds +{shard.added_s * 1000:.1f} ms per step, this plan +{per_block.added_s * 1000:.1f} ms"
    )
    return replace(per_block, shard_price=shard, shard_note=f"{words} priced, not chosen: {why}")


def block_range(spec: str, count: int) -> range:
    """The blocks of ``"5"`` or ``"2-5"`` among ``count``: ValueError when it is not an index or a range,
    IndexError when it is not inside 0..count-1 (the callers word the one-line error for their setting)."""
    lo, _, hi = spec.strip().partition("-")
    first, last = int(lo), int(hi) if hi else int(lo)
    if not 0 <= first <= last < count:
        raise IndexError(spec)
    return range(first, last + 1)


def parse_policy(text: str, count: int) -> dict[int, str]:
    """Block index -> technique from ``"0-2:recompute,5:compress"``; one-line ConfigError otherwise."""
    forced: dict[int, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        spec, sep, name = part.partition(":")
        name = name.strip()
        if not sep or name not in TECHNIQUES:
            raise ConfigError(
                f"memory.policy: '{part}' is not BLOCKS:TECHNIQUE (techniques: {', '.join(TECHNIQUES)}), "
                "e.g. 0-2:recompute,5:compress"
            )
        try:
            blocks = block_range(spec, count)
        except ValueError:
            raise ConfigError(f"memory.policy: '{spec}' is not a block index or a range like 2-5") from None
        except IndexError:
            raise ConfigError(
                f"memory.policy: block '{spec.strip()}' does not exist; the model's blocks are 0-{count - 1}"
            ) from None
        for index in blocks:
            forced[index] = name
    return forced


def parse_budget(text: str, total_bytes: int | None = None) -> int:
    """Bytes from ``memory.budget``: a size with a unit (``"2GiB"``) or a fraction of ``total_bytes``.

    A bare number in (0, 1] is a fraction of the device's memory (CUDA) or the host's (CPU); give it
    ``total_bytes``, or it is read from the host.
    """
    text = str(text).strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and 0 < number <= 1:
        return int(number * (total_bytes if total_bytes is not None else host_memory_bytes()))
    if number is not None:
        raise ConfigError(
            f"memory.budget: '{text}' is neither a fraction in (0, 1] nor a size with a unit such as 2GiB"
        )
    size = parse_bytes(text)
    if size <= 0:
        raise ConfigError("memory.budget must be > 0 (a size such as 2GiB or a fraction such as 0.5)")
    return size


def host_memory_bytes() -> int:
    """Physical memory of this host, in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def policy_plan(count: int, forced: Mapping[int, str]) -> tuple[str, ...]:
    """Techniques per block when only ``memory.policy`` is given: forced ones, keep elsewhere."""
    return tuple(forced.get(index, "keep") for index in range(count))


def check_memory_config(memory: object, *, hybrid: bool, block_count: Callable[[], int]) -> None:
    """One-line ConfigError for ``memory.*`` settings that cannot work together (before training)."""
    get = memory.__getattribute__
    planned = bool(str(get("budget")).strip() or str(get("policy")).strip())
    if hybrid and (planned or get("offload") != "none"):
        raise ConfigError(
            "memory.budget, memory.policy and memory.offload are for data parallelism; "
            "leave them unset with parallel.pp > 1 or a switch"
        )
    if planned and get("recompute") != "none":
        raise ConfigError(
            "memory.budget / memory.policy choose recomputation per block; leave memory.recompute at none"
        )
    if not planned and get("compress") != "none" and get("offload") != "none":
        raise ConfigError(
            "memory.compress and memory.offload both hook the saved activations; pick one, or let "
            "memory.budget / memory.policy mix them per block"
        )
    if get("offload") == "disk" and not str(get("offload_dir")).strip():
        raise ConfigError("memory.offload disk needs memory.offload_dir (a node-local directory)")
    if str(get("offload_dir")).strip():
        check_offload_dir(str(get("offload_dir")))
    if str(get("budget")).strip():
        parse_budget(str(get("budget")), total_bytes=1 << 30)
    if str(get("policy")).strip():
        parse_policy(str(get("policy")), block_count())
