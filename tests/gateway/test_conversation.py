"""Conversation memory over HTTP: two gateway apps sharing one real Redis send the same prefixes when
a conversation's turns alternate between them, tenants never share a conversation, and a hostile
`ctxgate.conversation_id` is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from ctxgate.gateway.app import create_app
from ctxgate.gateway.conversation import conversation_key
from ctxgate.gateway.key_admin import add_key
from ctxgate.gateway.settings import GatewaySettings
from tests.support.redis import RedisServer
from tests.support.servers import ServerThread, write_policy

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {"role": "system", "content": "Answer from the documents."}
PASSAGES = [
    {"title": f"Town {name}", "text": f"{name} lies on the river {river}. Its mayor is {mayor}."}
    for name, river, mayor in [
        ("Arlen", "Vey", "Ida Holm"),
        ("Brisk", "Orn", "Tomas Veld"),
        ("Cirra", "Lune", "Mara Quist"),
        ("Dovel", "Sarn", "Pell Ochs"),
    ]
]
TURNS = [
    ("Who is the mayor of Arlen?", [0, 1]),
    ("Which river runs through Brisk?", [1, 2]),
    ("Who is the mayor of Cirra?", [2, 3, 0]),
    ("Which river runs through Dovel?", [3]),
]


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(engine, redis_module, tmp_path_factory):
    """Two gateway apps, one Redis for their compression caches, one cache-salt secret."""
    root = tmp_path_factory.mktemp("conversation")
    keys_file = root / "keys.yaml"
    keys = {tenant: add_key(keys_file, tenant, policy="conv") for tenant in ("acme", "evil")}
    policy_dir = root / "policies"
    policy_dir.mkdir()
    write_policy(
        policy_dir,
        "conv",
        "name: conv\nmax_input_tokens: 1024\ndocuments: {max_tokens: 160}\n"
        "history: {strategy: extractive}\nconversation: {enabled: true}\n",
    )
    settings = GatewaySettings(
        policy_dir=policy_dir,
        keys_file=keys_file,
        embed_cache_url=redis_module.url,
        redis_url=None,
        cache_salt_secret="shared-by-the-replicas",
    )
    with (
        ServerThread(create_app(settings, engine=engine)) as one,
        ServerThread(create_app(settings, engine=engine)) as two,
    ):
        yield [one.url, two.url], keys


def compress(url: str, key: str, messages: list[dict], documents: list[dict], **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "ctxgate": {"documents": documents, **extra}}
    return httpx.post(
        f"{url}/v1/ctxgate/compress", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120
    )


def converse(urls: list[str], key: str, turns=TURNS, **extra) -> list[dict]:
    messages, answers = [SYSTEM], []
    for index, (question, passages) in enumerate(turns):
        messages.append({"role": "user", "content": question})
        response = compress(urls[index % len(urls)], key, messages, [PASSAGES[i] for i in passages], **extra)
        assert response.status_code == 200, response.text
        answers.append(response.json())
        messages.append({"role": "assistant", "content": f"Answer {index}."})
    return answers


def matched(answer: dict) -> int:
    return next(
        s["details"]["matched_turns"] for s in answer["report"]["stages"] if s["name"] == "conversation"
    )


def test_turns_alternating_between_replicas_send_the_same_prefixes(replicas):
    urls, keys = replicas
    answers = converse(urls, keys["acme"])
    for before, after in zip(answers, answers[1:], strict=False):
        assert after["messages"][: len(before["messages"])] == before["messages"]
    assert [matched(a) for a in answers] == [0, 1, 3, 5]
    # One replica alone sends the very same prompts (a conversation of its own: another id).
    alone = converse(urls[:1], keys["acme"], conversation_id="alone-1")
    assert [a["messages"] for a in alone] == [a["messages"] for a in answers]


def test_tenants_never_share_a_conversation(replicas):
    urls, keys = replicas
    converse(urls, keys["acme"], turns=TURNS[:1], conversation_id="shared-name")
    evil = converse(urls, keys["evil"], turns=[(TURNS[0][0], [3]), TURNS[1]], conversation_id="shared-name")
    carried = " ".join(m["content"] for m in evil[1]["messages"][1:-1])
    assert PASSAGES[3]["text"] in carried and PASSAGES[0]["text"] not in carried


@pytest.mark.parametrize(
    "conversation_id, mentions",
    [
        ("", "at least 1 character"),
        ("x" * 129, "at most 128 characters"),
        ("../../etc", "pattern"),
        ("a b", "pattern"),
        ("conv\nid", "pattern"),
        ("\u00e9t\u00e9", "pattern"),
        (12, "valid string"),
    ],
)
def test_a_hostile_conversation_id_is_a_400_naming_the_field(replicas, conversation_id, mentions):
    urls, keys = replicas
    response = compress(
        urls[0],
        keys["acme"],
        [SYSTEM, {"role": "user", "content": "Hi"}],
        [],
        conversation_id=conversation_id,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "ctxgate.conversation_id"
    assert mentions in error["message"]


def test_the_conversation_key_is_the_same_on_every_turn_and_per_tenant():
    first = [SYSTEM, {"role": "user", "content": "Who is the mayor of Arlen?"}]
    later = [*first, {"role": "assistant", "content": "Ida Holm."}, {"role": "user", "content": "And Brisk?"}]
    assert conversation_key("salt-a", first, None) == conversation_key("salt-a", later, None)
    assert conversation_key("salt-a", first, None) != conversation_key("salt-b", first, None)
    assert conversation_key("salt-a", first, "c-1") != conversation_key("salt-b", first, "c-1")
    assert conversation_key("salt-a", first, "c-1") != conversation_key("salt-a", first, "c-2")
    assert conversation_key("salt-a", [SYSTEM], None) is None


def test_routing_follows_the_conversation_key(engine):
    """On a model list, a RAG turn's cache-affinity key is its conversation's: turn 1 (whose
    compressed first user turn holds its passages) and turn 2 go to the same deployment."""
    from ctxgate.gateway.access import Access
    from ctxgate.gateway.keys import KeyStore, Tenant
    from ctxgate.gateway.model_list_config import ModelConfig

    group = ModelConfig(
        model_name="group", deployments=[{"url": "http://127.0.0.1:9"}], routing="cache_affinity"
    )
    access = Access(GatewaySettings(model_list=[group], cache_salt_secret="s"), engine, KeyStore(None))
    tenant = Tenant(name="acme")
    key = conversation_key(access.cache_salt("acme"), [SYSTEM, {"role": "user", "content": "Q1"}], None)
    turn_one = [SYSTEM, {"role": "user", "content": "Documents:\n[1] Arlen...\n\nQuestion: Q1"}]
    turn_two = [SYSTEM, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A"}]
    assert (
        access.route_key("group", tenant, turn_one, None, key)
        == access.route_key("group", tenant, turn_two, None, key)
        == key
    )
    # Without conversation memory the keys differ: the compressed first turns differ.
    assert access.route_key("group", tenant, turn_one, None) != access.route_key(
        "group", tenant, turn_two, None
    )
    assert access.route_key(MODEL, tenant, turn_one, None, key) is None  # not a model-list model
