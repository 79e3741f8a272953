"""Per-layer statistics of the quantized tensors: what ``metrics.jsonl`` gets every log interval and the
table printed at the end of a run."""

from __future__ import annotations

from typing import Any

from kaisoku.precision.quant import LayerQuant

#: Short column names of the tensors in the table.
_SHORT = {"weights": "w", "activations": "a", "gradients": "g"}


class PrecisionMonitor:
    """The quantized layers of a run and their scalers' figures."""

    def __init__(self, mode: str, layers: dict[str, LayerQuant], *, note: str = "") -> None:
        self.mode = mode
        self.layers = layers
        self.note = note
        """How the mode runs here (emulated, real fp8 for some layers), said once at the start."""

    def window(self) -> dict[str, Any]:
        """Per layer, per tensor: exponent, overflow rate, underflow fraction since the last call."""
        return {
            name: {
                tensor: _round(s.window()) for tensor, s in quant.scalers().items() if s.format.kind != "cast"
            }
            for name, quant in self.layers.items()
            if any(s.format.kind != "cast" for s in quant.scalers().values())
        }

    def totals(self) -> dict[str, Any]:
        """Per layer: format, and per tensor the latest exponent and the whole run's rates."""
        out: dict[str, Any] = {}
        for name, quant in self.layers.items():
            entry: dict[str, Any] = {"format": quant.label}
            for tensor, scaler in quant.scalers().items():
                if scaler.format.kind != "cast":
                    entry[tensor] = _round(scaler.totals())
            out[name] = entry
        return out

    def table_rows(self) -> list[dict[str, str]]:
        """One row per layer for the end-of-run table."""
        rows = []
        for name, entry in self.totals().items():
            row = {"layer": name, "format": entry["format"]}
            for key, label in (
                ("exponent", "exp"),
                ("overflow_rate", "overflow"),
                ("underflow_fraction", "underflow"),
            ):
                cells = []
                for tensor, short in _SHORT.items():
                    figures = entry.get(tensor)
                    value = None if figures is None else figures[key]
                    cells.append(f"{short}:-" if value is None else f"{short}:{_cell(value)}")
                row[label] = " ".join(cells)
            rows.append(row)
        return rows

    def print_table(self) -> None:
        """Print the per-layer table (rich)."""
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"precision.mode {self.mode}: per-layer exponent, overflow rate, underflow fraction"
        )
        for column in ("layer", "format", "exp", "overflow", "underflow"):
            table.add_column(column)
        for row in self.table_rows():
            table.add_row(*(row[c] for c in ("layer", "format", "exp", "overflow", "underflow")))
        Console().print(table)


def _round(figures: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in figures.items()}


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.2g}"
    return str(value)
