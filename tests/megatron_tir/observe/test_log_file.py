"""Rank 0's RUN_DIR/train.log (megatron_tir.observe.log_file): records from the block's start, held while the run
directory does not exist yet (train's directory gets its files only once start-up succeeded), megatron-core's INFO
chatter left out at the default level, nothing on the other ranks, nothing after the block."""

from __future__ import annotations

import logging

import pytest

from megatron_tir.observe.log_file import LOG_FILE, run_log_file

log = logging.getLogger("megatron_tir.test_log_file")


@pytest.fixture
def info_root():
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    yield root
    root.setLevel(level)


def _messages(path) -> list[str]:
    return [line.split(" INFO ", 1)[1] for line in path.read_text().splitlines()]


def test_records_wait_for_the_run_directory_then_come_first(tmp_path, info_root):
    run = tmp_path / "run"
    with run_log_file(run, rank0=True, create=False):
        log.info("learner ready: before the directory")
        log.debug("below the level")
        assert not run.exists()  # nothing made: start-up has not succeeded
        run.mkdir()
        log.info("step 1/1")
    log.info("after the block")
    assert _messages(run / LOG_FILE) == ["learner ready: before the directory", "step 1/1"]


def test_a_directory_that_never_comes_gets_nothing(tmp_path, info_root):
    with run_log_file(tmp_path / "run", rank0=True, create=False):
        log.info("engine start failed")
    assert not (tmp_path / "run").exists()


def test_create_appends_and_skips_megatron_info(tmp_path, info_root):
    run = tmp_path / "run"
    with run_log_file(run, rank0=True):
        log.info("first run")
    megatron = logging.getLogger("megatron.core.distributed")
    level = megatron.level
    megatron.setLevel(logging.INFO)  # megatron-core sets its own loggers' levels
    try:
        with run_log_file(run, rank0=True):  # a resume appends
            megatron.info("Params for bucket 1")
            megatron.warning("a megatron warning")
            log.info("resumed")
    finally:
        megatron.setLevel(level)
    lines = (run / LOG_FILE).read_text().splitlines()
    assert [x.split(" ", 2)[2] for x in lines] == [
        "megatron_tir.test_log_file INFO first run", "megatron.core.distributed WARNING a megatron warning",
        "megatron_tir.test_log_file INFO resumed"]


def test_other_ranks_write_nothing(tmp_path, info_root):
    with run_log_file(tmp_path / "run", rank0=False):
        log.info("rank 1")
    assert not (tmp_path / "run").exists()


def test_records_held_when_the_directory_came_after_them_are_written_at_the_end(tmp_path, info_root):
    """start_service makes the directory, then the first sync fails (printed, not logged): the held lines still
    reach the file."""
    run = tmp_path / "run"
    with run_log_file(run, rank0=True, create=False):
        log.info("learner ready")
        run.mkdir()
    assert _messages(run / LOG_FILE) == ["learner ready"]


def test_an_error_ending_the_block_is_in_the_file_with_its_traceback(tmp_path, info_root):
    """The caller reports it on the console after the block (the file already closed): the file gets it here."""
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="boom"), run_log_file(run, rank0=True):
        log.info("step 1/2")
        raise RuntimeError("boom")
    text = (run / LOG_FILE).read_text()
    assert "ERROR run stopped by RuntimeError: boom" in text
    assert "Traceback (most recent call last)" in text and 'raise RuntimeError("boom")' in text
