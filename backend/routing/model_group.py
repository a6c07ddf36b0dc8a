"""A served model backed by a group of deployments (`ModelGroup`).

`ModelGroup` is an `EngineClient` over its deployments (HTTP upstreams, or the built-in engine): a
strategy (`ctxgate.backend.routing.strategies`) orders them per request, the group skips the ejected ones and those at
their parallel limit, and fails over down the order on a connection error, a 5xx, a timeout or an
overload, as long as the client has seen nothing. Deltas with no text (a role-only opening chunk)
are held back until the first token or the end, so a failure before the first token is invisible
to the client and the request is safely replayed elsewhere; once a token flowed it never is.
The set of served models over these groups is `ModelRouter` (backend/routing/model_router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from ctxgate.backend.engine.api import (
    NO_GROUPS,
    EngineClient,
    EngineError,
    GenerationDelta,
    GenerationRequest,
    SideWorkRunner,
)
from ctxgate.backend.routing.deployment_health import DeploymentHealth, HealthPolicy
from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics, DeploymentState
from ctxgate.backend.routing.strategies import Router

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ctxgate.backend.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0


class Overloaded(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, status_code=503, code="overloaded")


@dataclass
class Deployment:
    """One place a model is served. `health_url`: the HTTP endpoint the prober asks (None: the
    built-in engine, asked through `is_ready`)."""

    name: str
    client: EngineClient
    weight: float = 1.0
    max_parallel: int | None = None
    health_url: str | None = None
    owned: bool = True  # stopped with the group (a built-in engine passed in by the caller is not)
    health: DeploymentHealth = field(default_factory=lambda: DeploymentHealth(HealthPolicy()))
    in_flight: int = 0

    def full(self) -> bool:
        return self.max_parallel is not None and self.in_flight >= self.max_parallel


def error_kind(exc: BaseException) -> str | None:
    """The error kind (deployment_errors) of a failure another deployment may fix; None when the
    failure is about the request itself (a 4xx) and would fail anywhere."""
    if isinstance(exc, EngineError):
        if exc.status_code in (429, 503):
            return "overloaded"
        if exc.status_code == 504:
            return "timeout"
        return "unavailable" if exc.status_code >= 500 else None
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.HTTPError | OSError):
        return "unavailable"
    return None


async def until_first_token(stream: AsyncIterator[GenerationDelta]) -> list[GenerationDelta]:
    """The deltas up to and including the first with text or a finish (all of them if the stream
    ends first): nothing of a request has reached the client before that."""
    held: list[GenerationDelta] = []
    async for delta in stream:
        held.append(delta)
        if delta.text or delta.finish_reason is not None:
            break
    return held


class ModelGroup:
    """EngineClient over a group of deployments serving one model."""

    def __init__(
        self,
        name: str,
        deployments: Sequence[Deployment],
        router: Router,
        metrics: DeploymentMetrics,
        probe_interval_s: float = 5.0,
    ) -> None:
        if not deployments:
            raise ValueError(f"model '{name}' has no deployments")
        kinds = {deployment.client.forwards_fields for deployment in deployments}
        if len(kinds) > 1:
            raise ValueError(
                f"model '{name}' mixes the built-in engine with HTTP upstreams; give each its own model"
            )
        self.model_name = name
        self.deployments = list(deployments)
        self.router = router
        self.metrics = metrics
        self.probe_interval_s = probe_interval_s
        self._running: dict[str, Deployment] = {}
        self._prober: asyncio.Task[None] | None = None
        self._probe_client: httpx.AsyncClient | None = None
        for deployment in self.deployments:
            metrics.declare(name, deployment.name)

    # -- what the gateway reads ----------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The smallest context of the group: a budget fitted to it fits on every deployment."""
        return min(deployment.client.max_model_len for deployment in self.deployments)

    @property
    def path_info(self) -> dict[str, object] | None:
        return self.deployments[0].client.path_info

    @property
    def forwards_fields(self) -> bool:
        return self.deployments[0].client.forwards_fields

    @property
    def groups(self) -> Mapping[str, EngineClient]:
        return NO_GROUPS  # one model, however many deployments serve it

    @property
    def side_work(self) -> SideWorkRunner | None:
        return self.deployments[0].client.side_work if len(self.deployments) == 1 else None

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.deployments[0].client.tokenizer

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    @property
    def needs_health_check(self) -> bool:
        return any(deployment.client.needs_health_check for deployment in self.deployments)

    def states(self) -> Iterator[DeploymentState]:
        for deployment in self.deployments:
            yield DeploymentState(
                self.model_name, deployment.name, deployment.in_flight, deployment.health.available()
            )

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        for deployment in self.deployments:
            deployment.client.start()
        if self.probe_interval_s > 0 and self._prober is None:
            with contextlib.suppress(RuntimeError):  # no running loop: no active probes
                self._prober = asyncio.get_running_loop().create_task(
                    self._probe_forever(), name=f"ctxgate-probe-{self.model_name}"
                )

    async def stop(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
            self._prober = None
        if self._probe_client is not None:
            await self._probe_client.aclose()
        for deployment in self.deployments:
            if deployment.owned:
                await deployment.client.stop()

    def is_ready(self) -> bool:
        return any(
            deployment.client.is_ready() and deployment.health.available() for deployment in self.deployments
        )

    async def check_health(self) -> bool:
        results = await asyncio.gather(
            *(deployment.client.check_health() for deployment in self.deployments), return_exceptions=True
        )
        return any(result is True for result in results)

    async def probe(self) -> None:
        """Ask every deployment's health endpoint once; eject the silent ones, restore the others."""
        await asyncio.gather(*(self._probe_one(deployment) for deployment in self.deployments))

    async def _probe_one(self, deployment: Deployment) -> None:
        if deployment.health_url is None:
            healthy = deployment.client.is_ready()
        else:
            if self._probe_client is None:
                self._probe_client = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S)
            try:
                healthy = (await self._probe_client.get(deployment.health_url)).status_code == 200
            except httpx.HTTPError:
                healthy = False
            if healthy and deployment.client.needs_health_check:
                await deployment.client.check_health()  # learn the model name it serves
        if deployment.health.probe(healthy):
            self.metrics.ejections.labels(self.model_name, deployment.name).inc()
            logger.warning(
                "deployment %s of model %s ejected: health probe failed", deployment.name, self.model_name
            )

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe()
            except Exception:  # the prober must outlive anything one probe does
                logger.exception("health probe of model %s failed", self.model_name)

    # -- routing -------------------------------------------------------------------------------
    def candidates(self, key: str | None) -> tuple[list[Deployment], Deployment | None]:
        """Deployments to try in order (routable ones first, the ejected as a last resort), and the
        deployment expected to hold the key's prefix under cache affinity."""
        choice = self.router.choose(self.deployments, key)
        ordered = [self.deployments[i] for i in choice.order]
        up = [deployment for deployment in ordered if deployment.health.available()]
        down = [deployment for deployment in ordered if deployment not in up]
        affine = self.deployments[choice.affine] if choice.affine is not None else None
        return up + down, affine

    def _failed(self, deployment: Deployment, kind: str) -> None:
        self.metrics.errors.labels(self.model_name, deployment.name, kind).inc()
        if kind != "overloaded" and deployment.health.failure():
            self.metrics.ejections.labels(self.model_name, deployment.name).inc()
            logger.warning(
                "deployment %s of model %s ejected after failures", deployment.name, self.model_name
            )

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        ordered, affine = self.candidates(request.route_key)
        problems: list[str] = []
        overloaded = 0
        for deployment in ordered:
            if deployment.full():
                overloaded += 1
                continue
            deployment.in_flight += 1
            self._running[request.request_id] = deployment
            started = time.perf_counter()
            stream = deployment.client.generate(request)
            try:
                try:
                    held = await until_first_token(stream)
                except Exception as exc:
                    kind = error_kind(exc)
                    if kind is None:
                        raise
                    self._failed(deployment, kind)
                    overloaded += kind == "overloaded"
                    problems.append(f"{deployment.name}: {kind}")
                    continue
                deployment.health.success()
                self.router.served(request.route_key, deployment.name)
                self._observe_start(deployment, affine, started)
                for delta in held:
                    yield delta
                try:
                    async for delta in stream:
                        yield delta
                except Exception as exc:
                    kind = error_kind(exc)
                    if kind is not None:
                        self._failed(deployment, "stream")
                    raise
                return
            finally:
                deployment.in_flight -= 1
                self._running.pop(request.request_id, None)
                with contextlib.suppress(Exception):
                    await stream.aclose()
        if overloaded == len(ordered):
            raise Overloaded(f"every deployment of model '{self.model_name}' is at its limit")
        raise EngineError(
            f"no deployment of model '{self.model_name}' could take the request: "
            + "; ".join(problems or ["all at their parallel limit"]),
            status_code=502,
        )

    def _observe_start(self, deployment: Deployment, affine: Deployment | None, started: float) -> None:
        labels = (self.model_name, deployment.name)
        self.metrics.ttft.labels(*labels).observe(time.perf_counter() - started)
        self.metrics.requests.labels(*labels).inc()
        if affine is deployment:
            self.metrics.affinity_hits.labels(*labels).inc()

    async def abort(self, request_id: str) -> None:
        deployment = self._running.get(request_id)
        if deployment is not None:
            await deployment.client.abort(request_id)
