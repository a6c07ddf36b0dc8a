"""A real gateway with the console on: an admin key file, a keys file with one tenant, a policy
directory the console may edit; and a logged-in HTTP client."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx

from ctxgate.gateway.key_admin import add_key

POLICY = (
    "name: console-test\nmax_input_tokens: 220\nreserve_output_tokens: 4\n"
    "documents: {max_tokens: 120, from_messages: true}\nquota: {requests_per_minute: 1000, tokens_per_day: 1000000}\n"
)
TOWNS = ["Arlen", "Brisk", "Cobb", "Dune", "Elm", "Fenn", "Gale", "Hollow"]
PASSAGES = [
    f"The town of {town} lies on the river {town[::-1]} and was founded in {1700 + 13 * i}. Its mill "
    f"grinds barley for {i + 2} villages and its bridge has {i + 3} arches of grey stone."
    for i, town in enumerate(TOWNS)
]
MODEL = "SmolLM2-135M-Instruct"
_CSRF = re.compile(r'name="csrf_token" value="([0-9a-f]+)"')


@dataclass
class ConsoleFiles:
    admin_key: str
    admin_key_file: Path
    keys_file: Path
    policy_dir: Path
    tenant_key: str


def console_files(root: Path) -> ConsoleFiles:
    admin_key = secrets.token_hex(32)
    admin_key_file = root / "admin.key"
    admin_key_file.write_text(admin_key + "\n")
    policy_dir = root / "policies"
    policy_dir.mkdir()
    (policy_dir / "console-test.yaml").write_text(POLICY)
    keys_file = root / "keys.yaml"
    tenant_key = add_key(keys_file, "acme", policy="console-test")
    return ConsoleFiles(admin_key, admin_key_file, keys_file, policy_dir, tenant_key)


def logged_in(url: str, admin_key: str) -> httpx.Client:
    client = httpx.Client(base_url=url, timeout=120)
    response = client.post("/console/login", data={"admin_key": admin_key})
    assert response.status_code == 303, response.text
    return client


def csrf_of(client: httpx.Client, path: str = "/console") -> str:
    page = client.get(path)
    assert page.status_code == 200, page.text
    match = _CSRF.search(page.text)
    assert match is not None, "no CSRF token on the page"
    return match.group(1)


def chat(url: str, key: str, documents: list[str] | None = None, question: str = "When was Cobb founded?"):
    extension = {"documents": [{"text": text} for text in documents]} if documents else {}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
        "ctxgate": extension,
    }
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
