"""The set of served models of a model list (`ModelRouter`), over one `ModelGroup` each
(backend/routing/model_group.py).

`ModelRouter` is the `EngineClient` the gateway holds with a model list: it sends each request to
its model's group (`GenerationRequest.model`) and, when that group cannot take it before any token
flowed, to the model's fallbacks in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from ctxgate.backend.engine.api import (
    EngineError,
    GenerationDelta,
    GenerationRequest,
    SideWorkRunner,
)
from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics, Reexport
from ctxgate.backend.routing.model_group import ModelGroup, error_kind, until_first_token

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ctxgate.backend.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ModelRouter:
    """The served models of a model list, as one EngineClient; the first model is the default."""

    def __init__(
        self,
        groups: Sequence[ModelGroup],
        fallbacks: dict[str, list[str]],
        metrics: DeploymentMetrics,
        builtin_registry: CollectorRegistry | None = None,
    ) -> None:
        # `EngineClient.groups`: the gateway reads each served model's own limits from its group.
        self.groups: dict[str, ModelGroup] = {group.model_name: group for group in groups}
        self.fallbacks = fallbacks
        self.metrics = metrics
        self._primary = groups[0]
        self.model_name = self._primary.model_name
        metrics.watch(lambda: (state for group in self.groups.values() for state in group.states()))
        if builtin_registry is not None:
            metrics.registry.register(Reexport(builtin_registry))
        for name, targets in fallbacks.items():
            for target in targets:
                if self.groups[name].forwards_fields != self.groups[target].forwards_fields:
                    raise ValueError(
                        f"model '{name}' cannot fall back to '{target}': one is the built-in engine, "
                        "the other an HTTP upstream"
                    )

    @property
    def names(self) -> list[str]:
        return list(self.groups)

    def group(self, name: str | None) -> ModelGroup:
        return self.groups.get(name or self.model_name, self._primary)

    @property
    def max_model_len(self) -> int:
        return self._primary.max_model_len

    @property
    def path_info(self) -> dict[str, object] | None:
        return self._primary.path_info

    @property
    def forwards_fields(self) -> bool:
        """True when any model forwards (control tokens of every common template are neutralised)."""
        return any(group.forwards_fields for group in self.groups.values())

    @property
    def side_work(self) -> SideWorkRunner | None:
        return next((group.side_work for group in self.groups.values() if group.side_work is not None), None)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return next((group.tokenizer for group in self.groups.values() if group.tokenizer is not None), None)

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    @property
    def needs_health_check(self) -> bool:
        return any(group.needs_health_check for group in self.groups.values())

    def start(self) -> None:
        for group in self.groups.values():
            group.start()

    async def stop(self) -> None:
        for group in self.groups.values():
            await group.stop()

    def is_ready(self) -> bool:
        return all(group.is_ready() for group in self.groups.values())

    async def check_health(self) -> bool:
        await asyncio.gather(*(group.check_health() for group in self.groups.values()))
        return self.is_ready()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        first = self.group(request.model)
        allowed = request.allowed_models
        if allowed is not None and first.model_name not in allowed:
            raise EngineError(
                f"model '{first.model_name}' is not allowed for this request",
                status_code=403,
                param="model",
                code="model_not_allowed",
            )
        # A fallback serves the request under the key's authority: only models the key may use.
        chain = [
            first,
            *(
                self.groups[name]
                for name in self.fallbacks.get(first.model_name, [])
                if allowed is None or name in allowed
            ),
        ]
        for index, group in enumerate(chain):
            stream = group.generate(request)
            try:
                try:
                    held = await until_first_token(stream)
                except Exception as exc:
                    if index + 1 == len(chain) or error_kind(exc) is None:
                        raise
                    self.metrics.fallbacks.labels(first.model_name, chain[index + 1].model_name).inc()
                    logger.warning(
                        "model %s could not take request %s (%s); falling back to %s",
                        group.model_name,
                        request.request_id,
                        exc,
                        chain[index + 1].model_name,
                    )
                    continue
                for delta in held:
                    yield delta
                async for delta in stream:
                    yield delta
                return
            finally:
                with contextlib.suppress(Exception):
                    await stream.aclose()

    async def abort(self, request_id: str) -> None:
        for group in self.groups.values():
            await group.abort(request_id)
