"""A server started for an eval or bench run says what it is doing while it starts: the start, its
log's last line while it loads (a server that takes long is not hung), and when it is ready."""

from __future__ import annotations

import sys
import textwrap

from ctxgate.eval.server import GatewayProcess

# A real HTTP server that logs as ctxgate does and is ready only after a slow "load".
SLOW_SERVER = textwrap.dedent(
    """
    import http.server, sys, time
    print("2026-01-01 00:00:00 INFO ctxgate.startup [-]: loading the model", flush=True)
    time.sleep(2.0)
    print("2026-01-01 00:00:02 INFO ctxgate.startup [-]: engine ready", flush=True)

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ready).serve_forever()
    """
)


class SlowServer(GatewayProcess):
    what = "the slow server"

    def command(self) -> list[str]:
        return [sys.executable, "-c", SLOW_SERVER, str(self.port)]


def test_a_slow_start_reports_its_log_until_ready(tmp_path):
    said: list[str] = []
    log = tmp_path / "server.log"
    with SlowServer(log_path=log, status=said.append, heartbeat_s=0.5) as url:
        assert url.startswith("http://127.0.0.1:")
    assert said[0] == f"starting the slow server on {url}; its log: {log}"
    beats = said[1:-1]
    assert beats and all(line.startswith("still starting (") for line in beats)
    assert any(line.endswith("): loading the model") for line in beats), said
    assert said[-1].startswith(f"the slow server ready at {url} after ")
