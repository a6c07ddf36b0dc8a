"""Fixtures for gateway tests: the real engine shared by every gateway test server."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine(model_dir):
    """The real in-process engine, shared by every gateway test server in this session."""
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=str(model_dir), kv_cache_memory_mb=64, max_model_len=2048))
    yield engine
    engine.shutdown()


class RecordingEngine:
    """Wraps a real engine and records the requests it was handed, which ran to the end and which
    were cut short."""

    def __init__(self, inner):
        self.inner = inner
        self.model_name = inner.model_name
        self.max_model_len = inner.max_model_len
        self.path_info = inner.path_info
        self.tokenizer = inner.tokenizer
        self.metrics_registry = inner.metrics_registry
        self.forwards_fields = inner.forwards_fields
        self.side_work = inner.side_work
        self.groups = inner.groups
        self.finished: list[str] = []
        self.cut_short: list[str] = []
        self.aborted: list[str] = []
        self.requests: list = []  # GenerationRequest, as the gateway built them

    @property
    def needs_health_check(self) -> bool:
        return self.inner.needs_health_check

    def start(self) -> None:
        self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def is_ready(self) -> bool:
        return self.inner.is_ready()

    async def check_health(self) -> bool:
        return await self.inner.check_health()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.inner.abort(request_id)

    async def generate(self, request):
        self.requests.append(request)
        iterator = self.inner.generate(request)
        finished = False
        try:
            async for delta in iterator:
                finished = finished or delta.finish_reason is not None
                yield delta
        finally:
            (self.finished if finished else self.cut_short).append(request.request_id)
            await iterator.aclose()
