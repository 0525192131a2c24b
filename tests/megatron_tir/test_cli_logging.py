"""The megatron-tir CLI's log handler."""

from __future__ import annotations


def test_the_cli_logs_to_the_stderr_of_the_moment(capsys, monkeypatch):
    """A log line after ``sys.stderr`` was swapped (pytest's capture between tests) goes to the new stream,
    not to the closed one the handler saw first ("--- Logging error ---")."""
    import io
    import logging

    from megatron_tir.cli import _CurrentStderr

    first, second = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(_CurrentStderr())
    monkeypatch.setattr("sys.stderr", first)
    handler.emit(logging.makeLogRecord({"msg": "one"}))
    first.close()
    monkeypatch.setattr("sys.stderr", second)
    handler.emit(logging.makeLogRecord({"msg": "two"}))
    assert second.getvalue() == "two\n"
