"""The progress bar of ``kaisoku pack``: samples packed, over the rich console, or nothing."""

from __future__ import annotations


class PackProgress:
    """A rich progress bar over samples, or nothing."""

    def __init__(self, enabled: bool, description: str, total: int | None) -> None:
        self._progress = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            # No refresh thread (auto_refresh=False): the packing pool forks while the bar is live.
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("samples"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                auto_refresh=False,
            )
            self._task = self._progress.add_task(description, total=total)

    def __enter__(self) -> PackProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, samples: int) -> None:
        """Count ``samples`` more as packed."""
        if self._progress is not None:
            self._progress.advance(self._task, samples)
            self._progress.refresh()

    def log(self, message: str) -> None:
        """Print a line above the bar (or nowhere when disabled)."""
        if self._progress is not None:
            self._progress.console.print(message)
