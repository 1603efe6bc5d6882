"""The ASGI app the plugin registers for each of its FastAPI apps: built by its factory on the first request, so
that loading the plugin (in every Airflow process, task processes too) imports neither FastAPI nor Airflow's API
code."""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class LazyApp:
    def __init__(self, factory: Callable[[], Any]) -> None:
        self._factory = factory
        self._app: Any = None
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:
        if self._app is None:
            with self._lock:
                if self._app is None:
                    self._app = self._factory()
        await self._app(scope, receive, send)
