"""Per-tensor scaling from a history of absolute maxima: the shared exponent of a tensor and its statistics.

A tensor is stored as ``mantissa * 2**(e - top)`` for a shared exponent ``e`` (the position of the binary
point), chosen before the tensor is seen from the largest absolute value of its last ``H`` uses:
``e = ceil(log2(max(history)))`` (delayed scaling). Its first use, with no history yet, takes the tensor's
own maximum. ``top`` belongs to the format: ``bits - 1`` for signed fixed point (int8: 7, so the grid is
``2**(e-7)`` and values up to ``127 * 2**(e-7)`` fit), ``floor(log2(max))`` for fp8 (E4M3: 8, E5M2: 15),
so the history's maximum lands just below the format's largest power of two.

Two things are counted per use: values beyond the format's range (*overflow*, saturated) and non-zero
values that round to zero (*underflow*, as a fraction of the non-zero values). Everything stays on the
tensor's device; :meth:`ExponentScaler.window` reads the counts (one sync) and starts a new window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: Uses of a tensor whose absolute maxima set its exponent.
HISTORY = 16


@dataclass(frozen=True)
class Format:
    """A number format a tensor is rounded to."""

    name: str
    """int8, int16, e4m3, e5m2, bf16 or fp32."""
    kind: str
    """int (signed fixed point), float8 (fp8 with a shared power-of-two scale) or cast (round through dtype)."""
    max_value: float = 0.0
    """Largest magnitude in the format's own units (int8: 127; E4M3: 448)."""
    top: int = 0
    """Exponent of the largest power of two the history's maximum is mapped to (int8: 7; E4M3: 8)."""
    dtype: torch.dtype | None = None
    """The torch dtype values pass through (fp8 and bf16)."""


FORMATS: dict[str, Format] = {
    "int8": Format("int8", "int", 127.0, 7),
    "int16": Format("int16", "int", 32767.0, 15),
    "e4m3": Format("e4m3", "float8", 448.0, 8, torch.float8_e4m3fn),
    "e5m2": Format("e5m2", "float8", 57344.0, 15, torch.float8_e5m2),
    "bf16": Format("bf16", "cast", dtype=torch.bfloat16),
    "fp32": Format("fp32", "cast"),
}


def shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(amax))`` exactly (an int32 tensor); 0 where ``amax`` is 0 or not finite."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, e, torch.zeros_like(e)).to(torch.int32)


class AmaxHistory:
    """The last ``length`` absolute maxima of one tensor, kept in a ring on its device (no host sync)."""

    def __init__(self, length: int = HISTORY) -> None:
        if length < 1:
            raise ValueError(f"history length must be >= 1 (got {length})")
        self.length = length
        self._ring: torch.Tensor | None = None
        self._count = 0

    def __len__(self) -> int:
        return min(self._count, self.length)

    def reference(self, current: torch.Tensor) -> torch.Tensor:
        """The largest maximum in the history; ``current`` (this use's own maximum) while it is empty."""
        if self._ring is None or self._count == 0:
            return current.detach().float()
        return self._ring[: len(self)].amax()

    def append(self, amax: torch.Tensor) -> None:
        """Add one use's absolute maximum (the oldest one drops out once ``length`` are held)."""
        amax = amax.detach().float().reshape(())
        if self._ring is None or self._ring.device != amax.device:
            self._ring = torch.zeros(self.length, device=amax.device)
        self._ring[self._count % self.length] = amax
        self._count += 1

    def state_dict(self) -> dict[str, Any]:
        """The ring and how many values went in."""
        return {"ring": None if self._ring is None else self._ring.clone(), "count": self._count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._ring = state["ring"]
        self._count = int(state["count"])


def quantize(
    x: torch.Tensor, fmt: Format, exponent: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` rounded to ``fmt`` with shared ``exponent``: (dequantized tensor, overflow mask, underflow mask).

    Overflowing values saturate at the format's largest magnitude; ``cast`` formats only round (both masks
    empty). With ``generator``, fixed point rounds stochastically (up with probability equal to the
    fraction of a grid step: unbiased, so small values survive on average instead of vanishing).
    """
    if fmt.kind == "cast":
        out = x if fmt.dtype is None else x.to(fmt.dtype).to(x.dtype)
        none = torch.zeros((), dtype=torch.bool, device=x.device)
        return out, none, none
    shift = (fmt.top - exponent).float()
    scale = torch.pow(2.0, shift)  # powers of two: exact in float32
    scaled = x.float() * scale
    over = scaled.abs() > fmt.max_value
    clipped = scaled.clamp(-fmt.max_value, fmt.max_value)
    if fmt.kind == "int" and generator is not None:
        noise = torch.rand(clipped.shape, generator=generator, device=clipped.device, dtype=clipped.dtype)
        q = torch.floor(clipped + noise).clamp(-fmt.max_value, fmt.max_value)
    elif fmt.kind == "int":
        q = torch.round(clipped)
    else:
        assert fmt.dtype is not None
        q = clipped.to(fmt.dtype).float()
    under = (q == 0) & (x != 0)
    return (q / scale).to(x.dtype), over, under


class ExponentScaler:
    """One tensor's scaler: the exponent from its amax history, rounding to ``fmt``, overflow/underflow counts.

    ``fixed_exponent`` (not None) turns the statistics off: every use takes that exponent (the control
    that shows what the history buys).
    """

    def __init__(
        self,
        fmt: Format | str,
        *,
        history: int = HISTORY,
        fixed_exponent: int | None = None,
        stochastic_seed: int | None = None,
    ) -> None:
        self.format = FORMATS[fmt] if isinstance(fmt, str) else fmt
        self.stochastic_seed = stochastic_seed
        """Not None: fixed point rounds stochastically, from a generator keyed by this value."""
        self._generator: torch.Generator | None = None
        self.history = AmaxHistory(history)
        self.fixed_exponent = fixed_exponent
        self.exponent: torch.Tensor | None = None
        """The exponent of the latest use."""
        self._window: torch.Tensor | None = None  # elements, overflowed, non-zero, underflowed
        self._total: torch.Tensor | None = None

    def next_exponent(self, current_amax: torch.Tensor) -> torch.Tensor:
        """The exponent the next use gets: from the history (``current_amax`` while it is empty), or fixed."""
        if self.fixed_exponent is not None:
            return torch.full((), self.fixed_exponent, dtype=torch.int32, device=current_amax.device)
        return shared_exponent(self.history.reference(current_amax))

    def _record(
        self,
        x: torch.Tensor,
        amax: torch.Tensor,
        exponent: torch.Tensor,
        over: torch.Tensor,
        under: torch.Tensor,
    ) -> None:
        self.exponent = exponent
        self.history.append(amax)
        counts = torch.stack(
            [
                torch.tensor(float(x.numel()), device=x.device),
                over.sum().float(),
                (x != 0).sum().float(),
                under.sum().float(),
            ]
        )
        self._window = counts if self._window is None else self._window + counts
        self._total = counts if self._total is None else self._total + counts

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, *, record: bool = True) -> torch.Tensor:
        """``x`` rounded to the format; with ``record`` its maximum joins the history and the counts grow."""
        if self.format.kind == "cast":
            return quantize(x, self.format, torch.zeros((), dtype=torch.int32))[0]
        amax = x.detach().abs().amax().float()
        exponent = self.next_exponent(amax)
        out, over, under = quantize(x, self.format, exponent, self._rng(x.device))
        if record:
            self._record(x, amax, exponent, over, under)
        return out

    def _rng(self, device: torch.device) -> torch.Generator | None:
        if self.stochastic_seed is None or self.format.kind != "int":
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.stochastic_seed)
        return self._generator

    @torch.no_grad()
    def encode(self, x: torch.Tensor, *, record: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` as an fp8 tensor and the float32 scale that turns it back (``2**(e - top)``): the operands
        of a real fp8 matmul (``torch._scaled_mm``). For fp8 formats only."""
        fmt = self.format
        if fmt.kind != "float8" or fmt.dtype is None:
            raise ValueError(f"encode is for fp8 formats, not {fmt.name}")
        amax = x.detach().abs().amax().float()
        exponent = self.next_exponent(amax)
        scale = torch.pow(2.0, (fmt.top - exponent).float())
        scaled = x.float() * scale
        over = scaled.abs() > fmt.max_value
        q = scaled.clamp(-fmt.max_value, fmt.max_value).to(fmt.dtype)
        if record:
            self._record(x, amax, exponent, over, (q.float() == 0) & (x != 0))
        return q, scale.reciprocal()

    @staticmethod
    def _figures(counts: torch.Tensor | None) -> dict[str, float]:
        if counts is None:
            return {"overflow_rate": 0.0, "overflow_count": 0, "underflow_fraction": 0.0}
        elements, over, nonzero, under = counts.tolist()
        return {
            "overflow_rate": over / max(elements, 1.0),
            "overflow_count": int(over),
            "underflow_fraction": under / max(nonzero, 1.0),
        }

    def window(self) -> dict[str, Any]:
        """Exponent, overflow rate and count, underflow fraction since the last call (reads the device)."""
        figures = self._figures(self._window)
        self._window = None
        figures["exponent"] = None if self.exponent is None else int(self.exponent)
        return figures

    def totals(self) -> dict[str, Any]:
        """The same figures over the whole run."""
        figures = self._figures(self._total)
        figures["exponent"] = None if self.exponent is None else int(self.exponent)
        return figures


def exponent_of(values: list[float]) -> int:
    """``ceil(log2(max(values)))`` on the host, for tests and reports (0 for an empty or zero list)."""
    top = max((abs(v) for v in values), default=0.0)
    return math.ceil(math.log2(top)) if top > 0 else 0
