"""Resume a built trainer from the checkpoint ``--resume`` names, or from the newest valid one (``auto``).

A damaged checkpoint is found at one of two moments: when it is checked (a single file that does not load, a
sharded folder without its metadata or with a shard file missing or cut short), or, for a sharded folder,
while every rank reads its shards (a tensor that does not load): DCP then fails alike on every rank. Either
way ``auto`` reports it and moves on to the next older checkpoint, as it skips a damaged single file; a
named checkpoint that is damaged stops the run with one line that says what to do.
"""

from __future__ import annotations

from pathlib import Path

from kaisoku.distributed import env
from kaisoku.distributed.sharded_checkpoint import UnreadableCheckpointError
from kaisoku.engine.checkpoint import CheckpointManager
from kaisoku.engine.trainer import Trainer
from kaisoku.errors import KaisokuError

_REMEDY = "resume from an older checkpoint, or with --resume auto (it skips damaged checkpoints)"


def resume_trainer(trainer: Trainer, resume: str) -> None:
    """Load the checkpoint that ``resume`` names into ``trainer`` ("auto": the newest valid one; none yet is
    fine: the run starts fresh). A collective: every rank calls it and loads the same checkpoint.

    Rank 0 checks the checkpoint (its content checksums included) before any rank reads it; the others load
    what it chose. A damaged checkpoint is said on the terminal in one line: ``auto`` goes on to the next
    older one, a named one stops the run (UnreadableCheckpointError, exit 3).
    """
    assert trainer.checkpoints is not None
    path = _pick(trainer, resume, damaged=None)
    while True:
        if path is None:
            trainer.metrics.message("no checkpoint to resume from; starting fresh")
            return
        try:
            state = CheckpointManager.load(Path(path), verify=False)
            trainer.load_state_dict(state, source=f"checkpoint {path}")
            break
        except UnreadableCheckpointError as error:
            if resume != "auto":
                raise UnreadableCheckpointError(f"{error}; {_REMEDY}") from None
            # Found damaged while every rank read it: every rank raised this alike, and all move on together
            # (the older checkpoint overwrites whatever the failed read left in the model and optimizer).
            trainer.metrics.message(f"kaisoku: {error}; skipped")
            path = _pick(trainer, resume, damaged=Path(path))
    trainer.metrics.message(f"resumed from {path} at step {trainer.state.step}")
    old, new = int(state.get("world_size", 0)), trainer.world.world_size
    if old and old != new:
        # Sample order is keyed by (seed, epoch) and sliced by rank: the world size does not change it.
        trainer.metrics.log({"step": trainer.state.step, "event": "world_size", "from": old, "to": new})
        trainer.metrics.message(
            f"world size changed since the checkpoint: {old} -> {new} ranks; the sample order is unchanged"
        )


def _pick(trainer: Trainer, resume: str, *, damaged: Path | None) -> str | None:
    """The checkpoint every rank loads: rank 0 picks and checks it, so that all load the same one even while
    files change (``damaged``: one found damaged while loading; only older ones are considered). A named
    checkpoint that fails its check raises UnreadableCheckpointError on every rank alike."""
    checkpoints = trainer.checkpoints
    assert checkpoints is not None
    picked: tuple[str | None, str, bool] = (None, "", False)
    if trainer.world.is_main:
        if resume == "auto":
            if damaged is None:
                checkpoints.remove_partial()
            found = checkpoints.latest_valid(
                older_than=damaged, on_skip=lambda line: trainer.metrics.message(f"kaisoku: {line}")
            )
            picked = (str(found[0]) if found else None, "", False)
        else:
            try:
                CheckpointManager.load(Path(resume))
                picked = (resume, "", False)
            except UnreadableCheckpointError as error:
                picked = (None, f"{error}; {_REMEDY}", True)
            except KaisokuError as error:
                picked = (None, str(error), False)
    path, failed, damaged_named = env.broadcast_object(picked)
    if failed:
        raise (UnreadableCheckpointError if damaged_named else KaisokuError)(failed)
    return path  # type: ignore[no-any-return]
