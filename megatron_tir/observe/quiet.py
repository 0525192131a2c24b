"""Keep dependency chatter off the console at the default level (``megatron-tir --log-level``).

At ``info`` and above (everything but ``debug``):

* megatron-core's INFO records -- the per-bucket parameter lists of its DDP buffers, the
  ``DistributedDataParallelConfig`` / ``OptimizerConfig`` dumps, the Megatron-FSDP detection
  lines -- are dropped (its warnings and errors stay);
* the warnings megatron-core 0.16.1 prints on CPU: ``Apex is not installed. Falling back to
  Torch Norm`` (``megatron/core/models/backends.py``, ``gpt_layer_specs.py``), ``full scope is
  deprecated`` (``transformer_config.py``), and any ``DeprecationWarning`` / ``FutureWarning``
  raised from ``megatron.core`` or ``torch.distributed.checkpoint`` (checkpoint loading);
* transformers' and huggingface_hub's progress bars ("Loading weights") when stderr is not a
  terminal, so log files carry no carriage-return bars.

At ``debug`` everything is shown.
"""

from __future__ import annotations

import logging
import sys
import warnings

QUIET_LOGGERS = ("megatron.core",)
QUIET_MESSAGES = (r"Apex is not installed", r"full scope is deprecated", r"Transformer Engine and Apex are not installed")
QUIET_MODULES = (r"megatron\.core", r"torch\.distributed\.checkpoint")


def quiet_dependencies(level: int) -> None:
    """Apply the rules of the module docstring for a process logging at ``level``."""
    if level <= logging.DEBUG:
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:  # loggers that set their own level below ours still stop here
        quiet_handler(handler, level)
    for message in QUIET_MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    for module in QUIET_MODULES:
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=module)
    if not sys.stderr.isatty():
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover - transformers is a dependency
            pass
        try:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        except ImportError:  # pragma: no cover
            pass


def quiet_handler(handler: logging.Handler, level: int) -> None:
    """At ``info`` and above, ``handler`` drops megatron-core's INFO records (a handler attached later, such as
    the run's log file: :mod:`megatron_tir.observe.log_file`)."""
    if level > logging.DEBUG:
        handler.addFilter(_MegatronInfo())


class _MegatronInfo(logging.Filter):
    """Drops megatron-core records below WARNING even where megatron sets its loggers' levels itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith("megatron.core")
