"""Rank 0's copy of a run's log records: ``RUN_DIR/train.log`` (plain text, appended on a resume).

``train`` and ``sft`` attach it (:func:`run_log_file`) before the learner is built, so the file starts with the
learner's start-up line, and keep it to the end of the run (heartbeats, step lines, resume lines). It holds what
rank 0's console shows: the records from the root logger's level up, without megatron-core's INFO chatter
(:mod:`megatron_tir.observe.quiet`). ``train``'s run directory gets its files only once start-up succeeded (the
engine and the sandbox answered): with ``create=False`` the records wait in memory until the directory exists,
then go first into the file; if it never does, they were on the console only.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path

from megatron_tir.observe.quiet import quiet_handler

log = logging.getLogger(__name__)

LOG_FILE = "train.log"
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class _RunLogHandler(logging.Handler):
    """Appends formatted records to ``path``; holds them while ``path``'s directory does not exist yet."""

    def __init__(self, path: Path, level: int) -> None:
        super().__init__(level)
        self.path = path
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self._held: list[str] = []
        self._stream = None

    def _open(self) -> bool:
        """The file open, with the records held so far written first; False while the directory is missing."""
        if self._stream is None:
            if not self.path.parent.is_dir():
                return False
            self._stream = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._held, held = [], self._held
            for earlier in held:
                self._stream.write(earlier + "\n")
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            if not self._open():
                self._held.append(line)
                return
            self._stream.write(line + "\n")
            self._stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise into the caller
            self.handleError(record)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._held:  # the directory may have appeared after the last record (a start-up that then failed)
                self._open()
            if self._stream is not None:
                self._stream.close()
        self._stream = None
        super().close()


@contextlib.contextmanager
def run_log_file(run_dir: Path, *, rank0: bool, create: bool = True):
    """On rank 0 (``rank0``), the log records also go to ``RUN_DIR/train.log`` while the block lasts.
    ``create``: make the directory now; otherwise the records wait until someone else makes it."""
    if not rank0:
        yield
        return
    run_dir = Path(run_dir)
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    handler = _RunLogHandler(run_dir / LOG_FILE, root.getEffectiveLevel())
    quiet_handler(handler, root.getEffectiveLevel())
    root.addHandler(handler)
    try:
        yield
    except Exception as exc:
        # the caller reports it on the console once this block has ended (without the file): the file gets it here
        handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "run stopped by %s: %s",
                                      (type(exc).__name__, exc), sys.exc_info()))
        raise
    finally:
        root.removeHandler(handler)
        handler.close()
