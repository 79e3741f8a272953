"""engine/failures.py: the class, cause and hint of each failure, and which rank's failure decides."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from kaisoku.data.node_cache.tier_dirs import NodeCacheError
from kaisoku.data.shards.records import CorruptRecordError
from kaisoku.engine import failures
from kaisoku.engine.divergence import NonFiniteError
from kaisoku.engine.failures import Failure, classify, decide, mark_run, print_failure


class _Damaged(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        raise CorruptRecordError(
            "/d/shard-00003.kshard record 9 (sample 66) fails its checksum; re-pack or use skip_corrupt",
            file="/d/shard-00003.kshard",
            record=9,
        )


def test_a_damaged_record_raised_in_a_loader_worker_is_a_data_error_naming_file_and_record() -> None:
    loader = torch.utils.data.DataLoader(_Damaged(), num_workers=1)
    with pytest.raises(Exception) as caught:  # torch re-raises the worker's error, wrapped
        next(iter(loader))
    failure = classify(caught.value, data="/d")
    assert failure.kind == "data" and failure.exit_code == 3 and not failure.resumable
    assert failure.cause == "/d/shard-00003.kshard record 9 (sample 66) fails its checksum"
    assert "kaisoku inspect /d --verify" in failure.hint and "--data.skip-corrupt true" in failure.hint
    assert "skip-corrupt" not in classify(caught.value, skip_corrupt=True).hint


def test_each_known_class_and_an_unknown_error() -> None:
    assert classify(KeyboardInterrupt()).exit_code == 130
    assert classify(NonFiniteError("training diverged: x")).kind == "nonfinite"
    oom = classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), device="cuda:0")
    assert (oom.kind, oom.cause) == ("oom", "out of memory on cuda:0") and "--data.global-batch" in oom.hint
    peer = classify(RuntimeError("[pair.cc:561] Connection closed by peer [127.0.0.1]:1234"))
    assert peer.kind == "peer" and peer.exit_code == 6
    bug = classify(ZeroDivisionError("division by zero"))
    assert (bug.kind, bug.cause, bug.exit_code) == ("unknown", "ZeroDivisionError: division by zero", 1)


def test_a_rank_s_own_reason_beats_a_lost_peer_and_a_killed_rank_beats_those_that_lost_it() -> None:
    lost = Failure("peer", "lost contact", rank=0, step=7, time=1.0)
    data = Failure("data", "shard record 9", rank=1, step=7, time=2.0)
    assert decide([lost, data], [], interrupted=False) is data
    killed = decide([lost], [(1, "signal SIGKILL")], interrupted=False)
    assert (
        killed.kind == "peer"
        and killed.cause.startswith("rank 1 on ")
        and killed.cause.endswith("(signal SIGKILL)")
    )
    assert decide([lost], [], interrupted=True).kind == "interrupt"


def test_resume_is_suggested_only_when_a_checkpoint_can_help(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    peer = Failure("peer", "rank 1 on h died (signal SIGKILL)", resumable=True, step=5)
    print_failure(peer, tmp_path)
    first = capsys.readouterr().err.splitlines()
    assert first[0] == "kaisoku: error: rank 1 on h died (signal SIGKILL) (at step 5)"
    assert (
        first[1]
        == f"kaisoku: rerun with --resume auto (there is no checkpoint yet: it starts over); full logs in "
        f"{tmp_path / 'logs'}"
    )
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000004.pt").write_bytes(b"")
    print_failure(peer, tmp_path)
    assert "rerun with --resume auto to continue from checkpoint step 4" in capsys.readouterr().err
    print_failure(Failure("data", "bad record", "re-pack it", step=5), tmp_path)
    assert "--resume" not in capsys.readouterr().err


def test_a_hint_never_suggests_what_the_run_already_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    diverged = NonFiniteError("training diverged: the loss went non-finite at step 9")
    assert "--train.on-nonfinite rollback" in classify(diverged).hint
    assert "on-nonfinite" not in classify(diverged, on_nonfinite="rollback").hint
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step-00000004.pt").write_bytes(b"")
    print_failure(Failure("peer", "rank 1 on h died", resumable=True, step=5), tmp_path, resume="auto")
    hint = capsys.readouterr().err.splitlines()[1]
    assert "rerun the same command to continue from checkpoint step 4" in hint and "--resume" not in hint


def test_what_the_launcher_s_stop_breaks_is_not_the_rank_s_own_cause() -> None:
    # The launcher's SIGTERM goes to the rank's whole process group: its loader worker dies of it too.
    worker = RuntimeError("DataLoader worker (pid 8626) is killed by signal: Terminated. ")
    assert classify(worker).kind == "stopped"
    try:
        try:
            raise SystemExit(143)  # what the rank's SIGTERM handler raises
        except SystemExit:
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed. ") from None
    except RuntimeError as during_stop:
        assert classify(during_stop).kind == "stopped"
    # A worker killed on its own (the OOM killer's SIGKILL) is still the rank's cause.
    assert classify(RuntimeError("DataLoader worker (pid 9) is killed by signal: Killed. ")).kind == "unknown"


def test_a_stop_signal_during_cleanup_waits_for_the_cleanup_to_finish() -> None:
    # The launcher's SIGTERM can be delivered late, while the rank already cleans up after the error its
    # stopping peers caused: the cleanup (removing the RAM tier) must still run to its end.
    previous = signal.signal(signal.SIGTERM, failures.on_stop_signal)
    done: list[str] = []
    try:
        with pytest.raises(SystemExit) as stopped:
            with failures.stop_held():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("after the signal")
        assert stopped.value.code == 128 + signal.SIGTERM and done == ["after the signal"]
        with pytest.raises(RuntimeError, match="the rank's own"):  # an error already leaving goes on
            with failures.stop_held():
                os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError("the rank's own")
        with pytest.raises(SystemExit):  # outside the block, the signal leaves at once again
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("never")
        assert done == ["after the signal"]
    finally:
        signal.signal(signal.SIGTERM, previous)
        failures._STOP_SIGNALLED[0] = failures._LAUNCHER_GONE[0] = False


def test_an_unwritable_ram_dir_is_not_damaged_data() -> None:
    error = NodeCacheError("cannot write to data.ram_dir /x (Read-only file system); set --data.ram-dir ...")
    failure = classify(error, data="/d")
    assert failure.kind == "error" and failure.cause.startswith("cannot write to data.ram_dir /x")
    assert "inspect" not in failure.hint and "re-pack" not in failure.cause


def test_a_run_that_completes_after_a_failed_attempt_drops_that_attempts_cause(tmp_path: Path) -> None:
    """An elastic restart marks the dead attempt failed; the run that then completes says completed only."""
    mark_run(tmp_path, status="failed", failure="unknown", cause="rank 0 stopped", exit_code=None, step=7)
    mark_run(tmp_path, status="completed", ended=1.0)
    state = json.loads((tmp_path / "run.json").read_text())
    assert state["status"] == "completed" and state["step"] == 7
    assert not {"failure", "cause", "exit_code"} & set(state)
