"""Load noise stays at INFO: a worker that reconnects under a new identity with nothing left to retry is an
INFO line; one whose requests must run again is a WARNING."""

from __future__ import annotations

import logging

import pytest
from test_sandbox_failures import _reconnect_scenario, running_broker


@pytest.mark.parametrize("still_running", [True, False])
def test_reconnect_is_info_unless_requests_must_run_again(tmp_path, caplog, still_running):
    with caplog.at_level(logging.INFO, logger="sandbox_cluster.broker"):
        with running_broker(tmp_path, heartbeat_interval_s=0.5, heartbeat_liveness=20) as broker:
            _reconnect_scenario(broker, still_running)
    [record] = [r for r in caplog.records if "reconnected under a new identity;" in r.getMessage()]
    if still_running:  # adopted by the new identity: nothing lost, nothing retried
        assert record.levelno == logging.INFO and "0 request(s) to retry" in record.getMessage()
    else:
        assert record.levelno == logging.WARNING and "1 request(s) to retry" in record.getMessage()
