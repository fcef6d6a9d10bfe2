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
