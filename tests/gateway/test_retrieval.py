"""Retrieval through the gateway: `ctxgate.retrieval` reads an index built by `ctxgate index build`."""

from __future__ import annotations

import httpx

from ctxgate.gateway.app import create_app
from ctxgate.gateway.settings import GatewaySettings
from tests.support.servers import ServerThread


def test_retrieval_from_an_index_and_unknown_index(engine, tmp_path):
    import json

    from ctxgate.compression.store.index import build_index

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(
            json.dumps(row)
            for row in [
                {"id": "alps", "title": "Alps", "text": "Mont Blanc is the highest mountain in the Alps."},
                {"id": "seine", "title": "Seine", "text": "The Seine flows through Paris."},
            ]
        )
    )
    build_index(corpus, "geo", tmp_path / "indexes", show_progress=False)
    settings = GatewaySettings(index_dir=tmp_path / "indexes")
    with ServerThread(create_app(settings, engine=engine)) as running:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "Highest Alps peak?"}],
            "ctxgate": {"retrieval": {"index": "geo", "top_n": 1}},
        }
        response = httpx.post(f"{running.url}/v1/ctxgate/compress", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert "Mont Blanc" in json.dumps(response.json()["messages"])
        body["ctxgate"]["retrieval"]["index"] = "nope"
        missing = httpx.post(f"{running.url}/v1/ctxgate/compress", json=body, timeout=60)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "index_not_found"
        assert "nope" in missing.json()["error"]["message"] and str(tmp_path) not in missing.text
