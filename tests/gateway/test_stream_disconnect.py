"""A streaming client that gives up before its first token: nothing has been sent yet (no headers),
but the gateway must still notice, abort the request in the engine and give its reservation back,
so a queue of abandoned requests does not keep the engine prefilling for nobody."""

from __future__ import annotations

import asyncio
import time

import httpx

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.conftest import RecordingEngine
from tests.support.servers import ServerThread
from tests.support.waiting import eventually, wait_until_engine_idle

HOLD = "hold-me-in-the-queue"


class QueueingEngine(RecordingEngine):
    """The real engine, except that a request whose prompt says HOLD first waits 30 s, as it would
    behind a long queue: the client gives up meanwhile."""

    async def generate(self, request):
        if HOLD in (request.prompt_text or ""):
            await asyncio.sleep(30)
        async for delta in super().generate(request):
            yield delta


def body(text: str) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "ctxgate": {"policy": "passthrough"},
    }


def test_client_gone_before_the_first_token_aborts_the_request(engine, tmp_path):
    queueing = QueueingEngine(engine)
    app = create_app(GatewaySettings(policy_dir=tmp_path), engine=queueing)
    with ServerThread(app) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        started = time.monotonic()
        try:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/chat/completions",
                json=body(HOLD) | {"model": model},
                timeout=httpx.Timeout(1.0),
            ) as response:
                response.read()
            raise AssertionError("the held request answered")
        except httpx.ReadTimeout:
            pass  # the client gives up after 1 s without a byte and closes the connection
        eventually(
            lambda: len(queueing.aborted) == 1,
            timeout_s=10,
            interval_s=0.05,
            message=lambda: f"not aborted: {queueing.aborted}",
        )
        assert time.monotonic() - started < 20  # well before the 30 s hold would have ended
        gateway = app.state.gateway
        assert not gateway.budgets._pending  # nothing left counted as queued
        # The gateway serves the next client as before.
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body("Say hi.") | {"model": model}, timeout=60
        ) as response:
            assert response.status_code == 200 and "[DONE]" in response.read().decode()
    wait_until_engine_idle(engine)
