"""A model group over real `ctxgate engine serve` processes (and llama.cpp's `llama-server`): affinity
keeps a prefix on one replica, failures fail over and eject, probes restore, a replica killed mid-way
loses only requests that had started streaming, and a group that cannot take a request falls back."""

from __future__ import annotations

import asyncio
import re
import signal

import httpx
import pytest

from ctxgate.backend.engine.api import EngineClient, EngineError, GenerationRequest, SamplingParams
from ctxgate.backend.model.model_prepare import find_packaged_gguf
from ctxgate.backend.routing.deployment_health import DeploymentHealth, HealthPolicy
from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics
from ctxgate.backend.routing.model_group import Deployment, ModelGroup, Overloaded
from ctxgate.backend.routing.model_router import ModelRouter
from ctxgate.backend.routing.strategies import make_router
from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig
from tests.support.servers import engine_processes, free_port, llama_server, llama_server_binary

HITS = re.compile(r"^ctxgate:prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.MULTILINE)
SYSTEM = "You are a terse assistant for the town of Lakeview. " * 8


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    with engine_processes(model_dir, tmp_path_factory.mktemp("engines")) as running:
        yield [url for url, _ in running]


def deployment(url: str, policy: HealthPolicy | None = None, max_parallel: int | None = None) -> Deployment:
    client = UpstreamClient(
        UpstreamConfig(urls=[url], connect_timeout_s=1.0, retries=0, down_for_s=0.0), served_model_name="smol"
    )
    base = url.removesuffix("/v1")
    return Deployment(
        name=url,
        client=client,
        max_parallel=max_parallel,
        health_url=f"{base}/health",
        health=DeploymentHealth(policy or HealthPolicy(probe_interval_s=0)),
    )


def group_of(urls: list[str], routing: str = "least_outstanding", name: str = "smol", **kwargs) -> ModelGroup:
    return ModelGroup(
        name,
        [deployment(url, **kwargs) for url in urls],
        make_router(routing),
        DeploymentMetrics(),
        probe_interval_s=0,
    )


def request(
    index: int, question: str = "Say hi.", key: str | None = None, max_tokens: int = 2
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"r{index}",
        prompt_token_ids=[],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        model="smol",
        route_key=key,
    )


async def run(client, req: GenerationRequest) -> str:
    text = []
    async for delta in client.generate(req):
        text.append(delta.text)
    return "".join(text)


def sample(registry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def prefix_hits(url: str) -> float:
    return sum(float(value) for value in HITS.findall(httpx.get(f"{url}/metrics", timeout=10).text))


def test_a_router_declares_its_models_and_a_single_engine_none():
    """`EngineClient.groups` is how the gateway learns that one client serves several models, each with
    its own limits; nothing probes the client's class."""
    unreachable = [f"http://127.0.0.1:{free_port()}/v1"]
    small, large = group_of(unreachable, name="small"), group_of(unreachable, name="large")
    router = ModelRouter([small, large], {}, DeploymentMetrics())
    assert isinstance(router, EngineClient)
    assert dict(router.groups) == {"small": small, "large": large}
    client = small.deployments[0].client
    for single in (small, client):
        assert isinstance(single, EngineClient)
        assert dict(single.groups) == {}
    with pytest.raises(TypeError):  # shared by every single engine: nobody may add a model to it
        client.groups["other"] = small  # type: ignore[index]


async def test_affinity_keeps_a_prefix_on_one_replica(engines):
    group = group_of(engines, "cache_affinity")
    await group.check_health()
    before = [prefix_hits(url) for url in engines]
    for index in range(3):  # one after another: the owner is never over its share
        assert await run(group, request(index, f"Question {index}?", key="conversation-7"))
    served = [
        sample(group.metrics.registry, "ctxgate:deployment_requests_total", model="smol", deployment=url)
        for url in engines
    ]
    assert sorted(served) == [0, 3]
    owner = engines[served.index(3)]
    assert (
        sample(
            group.metrics.registry, "ctxgate:deployment_affinity_hits_total", model="smol", deployment=owner
        )
        == 3
    )
    gained = [prefix_hits(url) - was for url, was in zip(engines, before, strict=True)]
    assert gained[served.index(3)] >= 64 and gained[served.index(0)] == 0  # the system prompt, cached twice
    await group.stop()


async def test_dead_deployment_fails_over_is_ejected_and_probes_restore(engines):
    dead = f"http://127.0.0.1:{free_port()}"
    group = group_of(
        [dead, engines[0]], policy=HealthPolicy(failures_to_eject=1, eject_s=60, probe_interval_s=0)
    )
    await group.check_health()
    for index in range(4):
        assert await run(group, request(index))  # least outstanding tries the dead one first in its turn
    registry = group.metrics.registry
    assert (
        sample(registry, "ctxgate:deployment_errors_total", model="smol", deployment=dead, kind="unavailable")
        == 1
    )
    assert sample(registry, "ctxgate:deployment_ejections_total", model="smol", deployment=dead) == 1
    assert sample(registry, "ctxgate:deployment_up", model="smol", deployment=dead) == 0
    live = group.deployments[1]
    live.health.failure()  # its record says ejected (as after a failure burst) although it answers
    assert not live.health.available()
    await group.probe()  # the real /health: the live one is restored, the dead one stays out
    assert live.health.available() and not group.deployments[0].health.available()
    await group.stop()


async def test_full_deployments_overload_and_the_model_falls_back(engines):
    small = group_of([engines[0]], name="small", max_parallel=1)
    large = group_of([engines[1]], name="large")
    router = ModelRouter([small, large], {"small": ["large"]}, DeploymentMetrics())
    await router.check_health()
    long = request(1, "Count to fifty.", max_tokens=24)
    first = router.generate(long)
    await anext(first)  # holds small's only slot
    with pytest.raises(Overloaded):
        await run(small, request(2))
    assert await run(router, request(3))  # small is full: large answers
    assert (
        sample(router.metrics.registry, "ctxgate:model_fallbacks_total", model="small", fallback="large") == 1
    )
    await first.aclose()
    await router.stop()


async def test_replica_killed_mid_way_loses_only_started_streams(model_dir, engines, tmp_path):
    with engine_processes(model_dir, tmp_path, count=1) as extra:
        victim_url, victim = extra[0]
        group = group_of(
            [engines[0], victim_url], policy=HealthPolicy(failures_to_eject=1, probe_interval_s=0)
        )
        await group.check_health()
        started: set[str] = set()

        async def one(index: int) -> str:
            req = request(index, f"Tell me about item {index}.", max_tokens=16)
            async for delta in group.generate(req):
                if delta.text:
                    started.add(req.request_id)
            return req.request_id

        tasks = [asyncio.create_task(one(index)) for index in range(6)]
        await asyncio.sleep(1.0)
        victim.send_signal(signal.SIGKILL)
        tasks += [asyncio.create_task(one(index)) for index in range(6, 10)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        failed = [
            (index, result) for index, result in enumerate(results) if isinstance(result, BaseException)
        ]
        assert all(isinstance(result, EngineError) and f"r{index}" in started for index, result in failed), (
            failed
        )
        assert len(failed) < len(results)
        await group.stop()


async def test_llama_server_deployment(tmp_path, engines):
    binary = llama_server_binary()
    if binary is None:
        pytest.skip("$CTXGATE_LLAMA_SERVER is not set (CI sets it; see .ci/run)")
    with llama_server(binary, find_packaged_gguf(), tmp_path / "llama.log") as url:
        group = group_of([f"{url}/v1", engines[0]], "weighted_round_robin")
        await group.check_health()
        llama = group.deployments[0]
        assert llama.client.is_ready() and llama.health_url == f"{url}/health"
        texts = [await run(group, request(index, max_tokens=4)) for index in range(4)]
        assert all(texts)
        served = sample(
            group.metrics.registry, "ctxgate:deployment_requests_total", model="smol", deployment=f"{url}/v1"
        )
        assert served == 2  # weighted round robin: every other request went to llama-server
        await group.probe()
        assert llama.health.available()
        await group.stop()
