"""Screenshots of the console's main views for docs/console.md, with the browser the tests drive.

    python -m tests.gateway.console.screenshots [OUT_DIR]     (make console-screenshots)

Starts a gateway on the packaged model with the console on, sends a few requests from two tenants so
the figures are not empty, then saves one PNG per view (default docs/assets/console/).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from ctxgate.gateway.app import create_app
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.settings import GatewaySettings
from tests.gateway.console.support import PASSAGES, chat, console_files
from tests.support.browser import chromium_paths, start_chromium
from tests.support.servers import REPO, ServerThread

VIEWS = {
    "tenants": "/console",
    "savings": "/console/savings",
    "policies": "/console/policies",
    "engine": "/console/engine",
}
QUESTIONS = (
    "When was Cobb founded?",
    "How many arches has the bridge of Dune?",
    "What does the mill of Elm grind?",
)


def _engine():
    from ctxgate.backend.engine.async_engine import AsyncEngine
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.backend.model.model_prepare import prepare_default_model

    return AsyncEngine(
        EngineConfig(model=str(prepare_default_model()), kv_cache_memory_mb=64, max_model_len=2048)
    )


def main(out: Path) -> int:
    paths = chromium_paths()
    if paths is None:
        print("screenshots: install chromium, chromium-driver and selenium first", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    engine = _engine()
    with tempfile.TemporaryDirectory() as tmp:
        files = console_files(Path(tmp))
        second = add_key(files.keys_file, "globex", policy="console-test")
        settings = GatewaySettings(
            keys_file=files.keys_file,
            policy_dir=files.policy_dir,
            admin_key_file=files.admin_key_file,
            default_policy="console-test",
        )
        try:
            with ServerThread(create_app(settings, engine=engine)) as server:
                for key in (files.tenant_key, second):
                    for question in QUESTIONS:
                        chat(server.url, key, documents=PASSAGES, question=question)
                driver = start_chromium(*paths, width=1200, height=860)
                try:
                    driver.get(server.url + "/console/login")
                    driver.find_element("css selector", "#admin_key").send_keys(files.admin_key)
                    driver.find_element("css selector", "#login").click()
                    for name, path in VIEWS.items():
                        driver.get(server.url + path)
                        driver.save_screenshot(str(out / f"{name}.png"))
                finally:
                    driver.quit()
        finally:
            engine.shutdown()
    for png in sorted(out.glob("*.png")):
        print(f"{png} ({png.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "assets" / "console"))
