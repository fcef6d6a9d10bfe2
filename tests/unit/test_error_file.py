"""The error file a worker leaves for torch elastic's agent is whole or absent, never half written."""

import builtins
import json
import os
import sys

import pytest

from lockstep.runtime.faults import root_cause

pytestmark = pytest.mark.timeout(30)


class _StoppedMidWrite:
    """A file whose writer is stopped (SIGTERM from the agent) after half of its first write."""

    def __init__(self, handle):
        self._handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()

    def write(self, text):
        self._handle.write(text[: len(text) // 2])
        self._handle.flush()
        raise SystemExit(143)


def _raise_in_the_hook(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    root_cause.record_uncaught_exceptions()
    try:
        raise RuntimeError("the model's own error")
    except RuntimeError as error:
        return path, (type(error), error, error.__traceback__)


def test_a_worker_stopped_while_writing_its_error_file_leaves_none_rather_than_a_half_one(tmp_path, monkeypatch):
    path, raised = _raise_in_the_hook(tmp_path, monkeypatch)
    real_open, real_fdopen = builtins.open, os.fdopen
    monkeypatch.setattr(builtins, "open", lambda *a, **k: _StoppedMidWrite(real_open(*a, **k)))
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _StoppedMidWrite(real_fdopen(*a, **k)))
    with pytest.raises(SystemExit):
        sys.excepthook(*raised)
    monkeypatch.undo()
    # torch's agent parses every file that exists (ProcessFailure) and stops the launcher on a bad one.
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_the_error_file_holds_the_traceback_in_torch_elastics_format(tmp_path, monkeypatch):
    path, raised = _raise_in_the_hook(tmp_path, monkeypatch)
    sys.excepthook(*raised)
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "RuntimeError: the model's own error"
    assert "raise RuntimeError" in data["message"]["extraInfo"]["py_callstack"]
    assert list(tmp_path.iterdir()) == [path]


def _failure(tmp_path, local_rank, exitcode, text=None):
    """A worker's failure as torch elastic's agent records it (its error file, when the worker wrote one)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error-{local_rank}.json"
    if text is not None:
        path.write_text(json.dumps({"message": {"message": text.splitlines()[-1], "extraInfo": {
            "py_callstack": text, "timestamp": "100"}}}))
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(path))


_WAITED = ("Traceback (most recent call last):\n  ...\nlockstep.errors.CollectiveError: rank 0: all_gather #12 at "
           "validate.py:13 in <module> failed ([../gloo/transport/tcp/pair.cc:534] Connection closed by peer).\n"
           "Rank 1 ended the script while this rank still waits in a collective: every rank must run the same "
           "collectives.")


@pytest.mark.parametrize("rank_1", ["exited", "stopped by the agent"])
def test_the_jobs_report_names_a_rank_that_ended_its_script_also_when_the_agent_stopped_it_while_it_left(
        tmp_path, capsys, rank_1):
    """Rank 1 closed its Runtime and left; rank 0, waiting in a collective, failed. Whether rank 1's exit
    came before the agent saw rank 0's failure (exit 0: not a failure) or after (the agent stopped it with
    SIGTERM), the report's cause is rank 0 and it says that rank 1 ended the script."""
    from lockstep.runtime.launch import elastic

    failures = {0: _failure(tmp_path, 0, 1, _WAITED)}
    if rank_1 == "stopped by the agent":
        failures[1] = _failure(tmp_path, 1, -15)
    cause = elastic._report(failures, nproc=2, nnodes=1)
    printed = capsys.readouterr().err
    assert cause.startswith("lost a peer: rank 0 (local rank 0)"), cause
    assert "lockstep: rank 0 (local rank 0) on" in printed.splitlines()[0]
    assert "lockstep: rank 1 ended the script while the others still waited in a collective" in printed
    assert "SIGTERM" not in printed


def test_the_jobs_report_blames_a_rank_killed_from_outside_when_no_report_says_it_ended(tmp_path, capsys):
    """The same failures without the waiting rank's word that rank 1 ended: rank 1's signal is the cause."""
    from lockstep.runtime.launch import elastic

    lost = _WAITED.rsplit("\n", 1)[0]  # rank 0 only lost its peer
    cause = elastic._report({0: _failure(tmp_path, 0, 1, lost), 1: _failure(tmp_path, 1, -9)}, nproc=2, nnodes=1)
    assert cause.startswith("rank 1 (local rank 1)") and "SIGKILL" in cause, cause
    assert "ended the script" not in capsys.readouterr().err


def test_the_jobs_report_blames_a_rank_that_failed_itself_even_if_a_peer_says_it_ended(tmp_path, capsys):
    """Rank 1 raised (exit code 1) and its peer's report, from the store, says it ended the script: its own
    failure is the cause, not its peer's lost connection."""
    from lockstep.runtime.launch import elastic

    failures = {1: _failure(tmp_path, 1, 1, "Traceback ...\nRuntimeError: rank one gives up"),
                0: _failure(tmp_path, 0, 1, _WAITED)}
    cause = elastic._report(failures, nproc=2, nnodes=1)
    assert cause.startswith("rank 1 (local rank 1)") and "exit code 1" in cause, cause
    assert capsys.readouterr().err.startswith("lockstep: rank 1 (local rank 1)")
