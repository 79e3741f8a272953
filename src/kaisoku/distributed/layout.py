"""Parallel layouts (dp x pp) and switch schedules, checked from plain values with the arithmetic in the message.

Everything here is pure: no process group, no model, no environment. :func:`check_parallel` is the one
place a run's ``parallel.*`` settings are checked (config validation calls it, with the world size where it
is known before launching); :func:`resolve_schedule` turns the settings into the layouts a run trains
under on a given world.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kaisoku.errors import ConfigError, KaisokuError

_LAYOUT_TEXT = re.compile(r"^(?:dp(?P<dp>\d+))?(?:x?pp(?P<pp>\d+))?$")
_SEGMENT = re.compile(r"^(?P<layout>[a-z0-9]+)(?::(?P<start>\d+)-(?P<end>\d*))?$")

#: Units a switch schedule counts in.
SWITCH_UNITS: tuple[str, ...] = ("epoch", "step")
#: Schedule names accepted by ``parallel.schedule``.
SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees: ``dp`` data-parallel replicas of a pipeline with ``pp`` stages.

    ``dp * pp`` must equal the world size (see :meth:`check_world`).
    """

    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name, value in (("dp", self.dp), ("pp", self.pp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        """The number of ranks this layout occupies: ``dp * pp``."""
        return self.dp * self.pp

    def check_world(self, world_size: int) -> None:
        """Raise a one-line :class:`ConfigError` unless ``dp * pp == world_size``."""
        if self.world_size != world_size:
            raise ConfigError(
                f"parallel layout dp {self.dp} x pp {self.pp} = {self.world_size} but the world has "
                f"{world_size} ranks; choose parallel.dp and parallel.pp whose product is {world_size}"
            )

    @classmethod
    def resolve(cls, world_size: int, dp: int = -1, pp: int = 1) -> ParallelLayout:
        """The layout for ``world_size`` ranks; ``dp = -1`` means "the ranks left": ``world_size // pp``."""
        if dp == -1:
            if pp < 1 or world_size % pp != 0:
                raise ConfigError(
                    f"parallel.pp {pp} does not divide the world of {world_size} ranks; "
                    f"choose a pp that divides {world_size}"
                )
            dp = world_size // pp
        layout = cls(dp=dp, pp=pp)
        layout.check_world(world_size)
        return layout

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """Read ``"dp2xpp2"``, ``"dp4"`` or ``"pp4"`` (a missing degree is 1)."""
        match = _LAYOUT_TEXT.match(text.strip().lower())
        if match is None or (match["dp"] is None and match["pp"] is None):
            raise ConfigError(
                f"cannot read parallel layout '{text}'; write it like 'dp2xpp2', 'dp4' or 'pp4'"
            )
        return cls(dp=int(match["dp"] or 1), pp=int(match["pp"] or 1))

    def __str__(self) -> str:
        if self.pp == 1:
            return f"dp{self.dp}"
        if self.dp == 1:
            return f"pp{self.pp}"
        return f"dp{self.dp}xpp{self.pp}"


@dataclass(frozen=True)
class SwitchSegment:
    """One layout for the half-open range ``[start, end)``; ``end`` None runs to the end of training."""

    layout: ParallelLayout
    start: int
    end: int | None

    def __str__(self) -> str:
        return f"{self.layout}:{self.start}-{'' if self.end is None else self.end}"


@dataclass(frozen=True)
class SwitchSchedule:
    """Contiguous segments from 0 whose last is open-ended, counted in ``unit`` (epochs or steps)."""

    segments: tuple[SwitchSegment, ...]
    unit: str = "epoch"

    def layout_at(self, index: int) -> ParallelLayout:
        """The layout that trains epoch (or step) ``index``."""
        if index < 0:
            raise KaisokuError(f"{self.unit} {index} is negative")
        for segment in self.segments:
            if segment.end is None or index < segment.end:
                return segment.layout
        raise AssertionError("unreachable: the last segment is open-ended")

    def switch_at(self, index: int) -> ParallelLayout | None:
        """The new layout if a segment other than the first starts at ``index``, else None."""
        for segment in self.segments[1:]:
            if segment.start == index:
                return segment.layout
        return None

    @property
    def switch_points(self) -> list[int]:
        """The epochs (or steps) at which the layout changes."""
        return [segment.start for segment in self.segments[1:]]

    def check_world(self, world_size: int) -> None:
        """Every layout of the schedule must fill ``world_size`` ranks."""
        for segment in self.segments:
            segment.layout.check_world(world_size)

    def __str__(self) -> str:
        return ",".join(str(segment) for segment in self.segments)


def parse_switch_schedule(text: str, unit: str = "epoch") -> SwitchSchedule:
    """Read ``"LAYOUT:START-END,...,LAYOUT:START-"`` (``LAYOUT`` as ``dp2xpp2``, ``dp4``, ``pp4``).

    Ranges are half-open and counted in ``unit`` ("epoch" or "step"); they start at 0, follow one another
    without gap or overlap, and only the last is open-ended. A single layout without a range (``"dp4"``)
    means that layout throughout.
    """
    option = "parallel.switch"
    if unit not in SWITCH_UNITS:
        raise ConfigError(f"unknown parallel.switch_unit '{unit}'; choose one of: {', '.join(SWITCH_UNITS)}")
    parts = [part.strip() for part in text.replace(" ", "").lower().split(",")]
    if not text.strip() or any(not part for part in parts):
        raise ConfigError(f"{option} '{text}' has an empty segment; write it like 'dp2xpp2:0-10,dp4:10-'")
    segments: list[SwitchSegment] = []
    expected_start = 0
    for number, part in enumerate(parts):
        match = _SEGMENT.match(part)
        if match is None:
            raise ConfigError(f"{option} segment '{part}' should read LAYOUT:START-END, like 'dp2xpp2:0-10'")
        layout = ParallelLayout.parse(match["layout"])
        last = number == len(parts) - 1
        if match["start"] is None:
            if len(parts) != 1:
                raise ConfigError(
                    f"{option} segment '{part}' needs a range ({unit}s START-END) beside others"
                )
            return SwitchSchedule((SwitchSegment(layout, 0, None),), unit)
        start = int(match["start"])
        end = int(match["end"]) if match["end"] else None
        if start != expected_start:
            what = "start at 0" if number == 0 else f"start where the previous ended, at {expected_start}"
            raise ConfigError(f"{option} segment '{part}' should {what} ({unit}s)")
        if end is None and not last:
            raise ConfigError(f"{option} segment '{part}' is open-ended but is not the last")
        if end is not None and last:
            raise ConfigError(
                f"{option} last segment '{part}' must be open-ended ('{layout}:{start}-') "
                f"so that every {unit} has a layout"
            )
        if end is not None and end <= start:
            raise ConfigError(f"{option} segment '{part}' ends at {end}, not after its start {start}")
        segments.append(SwitchSegment(layout, start, end))
        expected_start = end if end is not None else start
    return SwitchSchedule(tuple(segments), unit)


def check_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    """One-line errors for a schedule the torch schedules would reject later, mid-run."""
    if schedule not in SCHEDULE_NAMES:
        raise ConfigError(
            f"unknown parallel.schedule '{schedule}'; choose one of: {', '.join(SCHEDULE_NAMES)}"
        )
    if microbatches < 1:
        raise ConfigError(f"parallel.microbatches must be at least 1, got {microbatches}")
    if virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages must be at least 1, got {virtual_stages}")
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise ConfigError(
            f"parallel.virtual_stages {virtual_stages} needs parallel.schedule 'interleaved-1f1b', not '{schedule}'"
        )
    if pp > 1 and schedule == "1f1b" and microbatches < pp:
        raise ConfigError(
            f"schedule 1f1b needs at least pp {pp} micro-batches, got parallel.microbatches {microbatches}"
        )
    if pp > 1 and schedule == "interleaved-1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds != 0:
            raise ConfigError(
                f"schedule interleaved-1f1b runs {microbatches} micro-batches in {rounds} rounds of pp {pp}; "
                f"choose parallel.microbatches as a multiple of {pp} or at most {pp}"
            )


def check_layout_batch(global_batch: int, layout: ParallelLayout, microbatches: int) -> None:
    """A one-line ConfigError unless the global batch splits into ``layout``'s replicas and micro-batches."""
    if global_batch % layout.dp:
        raise ConfigError(
            f"data.global_batch {global_batch} does not split into {layout.dp} replica batches "
            f"(layout {layout}); use a multiple of {layout.dp}"
        )
    replica = global_batch // layout.dp
    if layout.pp > 1 and replica % microbatches:
        raise ConfigError(
            f"the replica batch of {replica} samples (data.global_batch {global_batch} / dp {layout.dp}, "
            f"layout {layout}) does not split into parallel.microbatches {microbatches} equal micro-batches; "
            f"make data.global_batch a multiple of {layout.dp * microbatches}"
        )


def check_stage_count(blocks: int, layout: ParallelLayout, virtual_stages: int) -> None:
    """A one-line ConfigError when ``layout`` asks for more pipeline stages than the model has blocks."""
    stages = layout.pp * virtual_stages
    if layout.pp > 1 and stages > blocks:
        raise ConfigError(
            f"layout {layout} needs {stages} pipeline stages (pp {layout.pp} x parallel.virtual_stages "
            f"{virtual_stages}) but the model has only {blocks} blocks; use at most {blocks} stages"
        )


def is_hybrid(pp: int, switch: str) -> bool:
    """True when a run trains on pipeline stages or switches layout (``pp > 1`` or a switch schedule)."""
    return pp > 1 or bool(switch.strip())


def resolve_schedule(
    world_size: int, *, dp: int = -1, pp: int = 1, switch: str = "", unit: str = "epoch"
) -> SwitchSchedule:
    """The layouts a run trains under on ``world_size`` ranks: the switch schedule, or dp x pp throughout.

    ``dp = -1`` takes the ranks left (``world_size // pp``). One-line ConfigErrors show the arithmetic.
    """
    if is_hybrid(pp, switch) and world_size < 2:
        what = f"parallel.switch '{switch}'" if switch.strip() else f"parallel.pp {pp}"
        raise ConfigError(
            f"{what} needs a world of at least 2 ranks, this one has {world_size}; "
            "launch more ranks (--nproc) or leave parallel.* at its defaults"
        )
    if switch.strip():
        schedule = parse_switch_schedule(switch, unit)
        schedule.check_world(world_size)
        return schedule
    layout = ParallelLayout.resolve(world_size, dp=dp, pp=pp)
    return SwitchSchedule((SwitchSegment(layout, 0, None),), unit)


def check_parallel(
    *,
    world_size: int | None,
    global_batch: int,
    dp: int = -1,
    pp: int = 1,
    microbatches: int = 4,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    switch: str = "",
    unit: str = "epoch",
    block_count: Callable[[], int] | None = None,
) -> SwitchSchedule | None:
    """Check a run's parallel settings; return its resolved schedule when ``world_size`` is known, else None.

    Checks the degrees, the switch schedule's text, the pipeline schedule against each layout's pp and
    micro-batches, the split of the global batch into replicas and micro-batches, dp x pp against the world
    (when known) and, for layouts with pipeline stages, the model's block count (``block_count`` is called
    only then).
    """
    if dp != -1 and dp < 1:
        raise ConfigError(f"parallel.dp must be -1 (the ranks left) or >= 1 (got {dp})")
    if pp < 1:
        raise ConfigError(f"parallel.pp must be >= 1 (got {pp})")
    if microbatches < 1:
        raise ConfigError(f"parallel.microbatches must be >= 1 (got {microbatches})")
    if virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages must be >= 1 (got {virtual_stages})")
    resolved: SwitchSchedule | None = None
    if world_size is not None:
        resolved = resolve_schedule(world_size, dp=dp, pp=pp, switch=switch, unit=unit)
        layouts = [segment.layout for segment in resolved.segments]
    elif switch.strip():
        layouts = [segment.layout for segment in parse_switch_schedule(switch, unit).segments]
    else:
        # dp comes from the world, which is not known yet; the stages do not depend on it.
        layouts = [ParallelLayout(dp=1 if dp == -1 else dp, pp=pp)]
    if not is_hybrid(pp, switch):
        return resolved
    for layout in layouts:
        check_schedule(schedule, layout.pp, microbatches, virtual_stages)
        if world_size is not None or dp != -1 or switch.strip():
            check_layout_batch(global_batch, layout, microbatches)
    pipelines = [layout for layout in layouts if layout.pp > 1]
    if pipelines and block_count is not None:
        blocks = block_count()
        for layout in pipelines:
            check_stage_count(blocks, layout, virtual_stages)
    return resolved
