"""The tests' rank launcher: :func:`kaisoku.distributed.spawn.run_ranks`, which the benchmarks use too.

Usage in a test (the function must live at module level so the child can import it)::

    def _body(rank: int, world_size: int, tmp: Path) -> float:
        ...
        return value

    def test_x(tmp_path):
        results = run_ranks(_body, world_size=2, tmp_path=tmp_path)
"""

from kaisoku.distributed.spawn import run_ranks

__all__ = ["run_ranks"]
