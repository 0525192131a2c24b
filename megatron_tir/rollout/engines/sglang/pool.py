"""The SGLang servers a client talks to, their health, and which one takes a request.

Routing: a request with a ``route_key`` goes to the server that took the key's first
request while that server is healthy (sticky affinity: the turns of one trajectory share
a growing prefix, which that server's radix cache holds); otherwise, and for requests
without a key, to the healthy server with the fewest requests in flight (ties: round
robin). Servers marked stale (they answered with older weights than the engine's: they
restarted, or missed a weight sync) get no work until a weight sync brings them back. When a key's server is down or failed the request, the key moves to the server
chosen instead. The key table keeps the ``max_keys`` most recently used keys.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class ServerState:
    url: str
    healthy: bool = True
    in_flight: int = 0
    last_error: str | None = None
    stale: bool = False  # serves other weights than the engine's (it restarted): no work until a sync


class ServerPool:
    """Sticky-by-key, else least-in-flight, choice among healthy servers (module docstring)."""

    def __init__(self, urls: Sequence[str], *, max_keys: int = 100_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.servers = [ServerState(url=u) for u in urls]
        self.max_keys = max_keys
        self._turn = itertools.count()
        self._affinity: collections.OrderedDict[str, ServerState] = collections.OrderedDict()

    def pick(self, exclude: Sequence[ServerState] = (), key: str | None = None) -> ServerState | None:
        candidates = [s for s in self.servers if s.healthy and not s.stale and s not in exclude]
        if not candidates:
            return None
        if key is not None:
            pinned = self._affinity.get(key)
            if pinned is not None and pinned in candidates:
                self._affinity.move_to_end(key)
                return pinned
        least = min(s.in_flight for s in candidates)
        tied = [s for s in candidates if s.in_flight == least]
        chosen = tied[next(self._turn) % len(tied)]
        if key is not None:
            self._affinity[key] = chosen
            self._affinity.move_to_end(key)
            if len(self._affinity) > self.max_keys:
                self._affinity.popitem(last=False)
        return chosen

    def mark_down(self, server: ServerState, why: str) -> None:
        if server.healthy:
            log.warning("SGLang server %s marked unhealthy: %s", server.url, why)
        server.healthy, server.last_error = False, why

    def mark_stale(self, server: ServerState, why: str) -> None:
        if not server.stale:
            log.warning("SGLang server %s serves stale weights (%s): no work until the next weight sync",
                        server.url, why)
        server.stale = True

    def mark_fresh(self, servers: Sequence[ServerState] | None = None) -> None:
        """After a weight sync the servers it reached (None: all) serve the engine's weights."""
        for server in self.servers if servers is None else servers:
            if server.stale:
                log.info("SGLang server %s rejoined with the current weights", server.url)
            server.stale = False

    def mark_up(self, server: ServerState) -> None:
        if not server.healthy:
            log.info("SGLang server %s is healthy again", server.url)
        server.healthy, server.last_error = True, None
