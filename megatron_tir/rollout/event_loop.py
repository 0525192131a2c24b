"""An asyncio event loop on its own thread: rank 0's engine, sandbox and rollout driver live on it,
so a rollout can run while the main thread trains.

``submit(coro)`` schedules a coroutine and returns a ``concurrent.futures.Future`` at once;
``run(coro)`` waits for its result (the drop-in for ``asyncio.Runner.run``). Closing cancels
what is still running, stops the loop and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading


class EventLoopThread:
    """A context manager owning one event loop that runs forever on a daemon thread."""

    def __init__(self, name: str = "rollout-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro) -> concurrent.futures.Future:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("submit() from the loop's own thread would wait on itself")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro):
        return self.submit(coro).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    def __enter__(self) -> EventLoopThread:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
