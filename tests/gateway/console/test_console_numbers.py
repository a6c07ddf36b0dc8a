"""The savings page's figures equal the gateway's Prometheus counters for the same range: since the
start, and over the last 15 minutes (the counters' increase since the sample at the range's start)."""

from __future__ import annotations

import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.clock import FakeClock
from tests.gateway.console.page_figures import metrics_figures, minus, page_figures
from tests.gateway.console.support import PASSAGES, chat, console_files, logged_in
from tests.support.servers import ServerThread

START = 1_700_000_040.0 + 5


@pytest.fixture(scope="module")
def clock() -> FakeClock:
    return FakeClock(START)


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory, clock):
    files = console_files(tmp_path_factory.mktemp("numbers"))
    settings = GatewaySettings(
        keys_file=files.keys_file,
        policy_dir=files.policy_dir,
        admin_key_file=files.admin_key_file,
        default_policy="console-test",
    )
    app = create_app(settings, engine=engine, clock=clock)
    with ServerThread(app) as running:
        running.files = files
        running.console = app.state.console
        yield running


def test_the_page_equals_the_counters_since_start_and_over_a_range(server, clock):
    files = server.files
    client = logged_in(server.url, files.admin_key)
    first = chat(server.url, files.tenant_key, documents=PASSAGES)
    assert first.status_code == 200, first.text
    since_start = page_figures(client.get("/console/savings?range=all").text)
    counters = metrics_figures(server.url)
    assert since_start == counters
    (row,) = since_start.values()
    assert row["before"] > row["after"] > 0  # the passages were compressed: something was saved

    clock.advance(16 * 60)
    server.console.history.sample()  # what the minute sampler does; the fake clock jumped past it
    at_sample = metrics_figures(server.url)
    clock.advance(15 * 60)
    for question in ("When was Elm founded?", "How many arches has the bridge of Dune?"):
        assert chat(server.url, files.tenant_key, documents=PASSAGES, question=question).status_code == 200
    last_15m = page_figures(client.get("/console/savings?range=15m").text)
    now = metrics_figures(server.url)
    assert last_15m == minus(now, at_sample)
    assert page_figures(client.get("/console/savings?range=all").text) == now
    (recent,) = last_15m.values()
    assert 0 < recent["before"] < now[("acme", "console-test")]["before"]
