"""Limits per model inside a tenant or a key: checked with the scope's own limits and applied to all
meters or none, in both stores; the keys file refuses a limit for a model the key may not use."""

from __future__ import annotations

import pytest

from ctxgate.gateway.keys import read_keys_file
from ctxgate.gateway.quota import InProcessQuotaStore, QuotaExceeded, QuotaLimits, RedisQuotaStore

NOW = 1_700_000_045.0
SHA = "ab" * 32


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        yield InProcessQuotaStore()
        return
    redis_store = RedisQuotaStore(request.getfixturevalue("redis_server").url)
    yield redis_store
    await redis_store.close()


async def test_a_key_model_limit_refuses_that_model_only_and_applies_nothing_when_it_refuses(store):
    tenant = QuotaLimits(tokens_per_minute=10_000)
    key = QuotaLimits.from_mapping(
        {"requests_per_minute": 100, "models": {"big": {"tokens_per_minute": 300}}}, inherit=tenant
    )
    scopes = {"key_id": "k1", "key_limits": key}
    await store.reserve("acme", tenant, 200, 0, now=NOW, **scopes, model="big")
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("acme", tenant, 200, 0, now=NOW + 1, **scopes, model="big")
    assert refused.value.reason == "tokens_per_minute"
    assert "API key 'k1' for model 'big' is over its tokens_per_minute quota" in str(refused.value)
    assert (refused.value.usage.owner, refused.value.usage.model) == ("key", "big")
    await store.reserve("acme", tenant, 5000, 0, now=NOW + 1, **scopes, model="small")
    used = {
        (u.name, u.owner, u.model): u.used
        for u in await store.usage("acme", tenant, NOW + 2, **scopes, model="big")
    }
    # The refused reservation added nothing to the tenant's or the key's meters.
    assert used == {
        ("tokens_per_minute", "tenant", None): 5200,
        ("requests_per_minute", "key", None): 2,
        ("tokens_per_minute", "key", "big"): 200,
    }
    with pytest.raises(
        QuotaExceeded, match="alone needs more than the API key's tokens_per_minute quota for model"
    ):
        await store.reserve("acme", tenant, 301, 0, now=NOW + 2, **scopes, model="big")


async def test_a_tenant_model_budget_holds_for_every_key_of_the_tenant(store):
    tenant = QuotaLimits.from_mapping(
        {"time_zone": "Europe/Berlin", "models": {"big": {"budget": 1.0, "budget_period": "daily"}}}
    )
    assert tenant.models["big"].time_zone == "Europe/Berlin"  # a model's zone is its owner's
    await store.reserve("t", tenant, 10, 600_000, now=NOW, model="big")
    with pytest.raises(QuotaExceeded) as refused:
        await store.reserve("t", tenant, 10, 600_000, now=NOW, key_id="other", model="big")
    assert refused.value.reason == "budget" and refused.value.usage.resets_at.endswith("+01:00")
    await store.reserve("t", tenant, 10, 600_000, now=NOW, model="small")


def test_the_keys_file_refuses_a_limit_for_a_model_the_key_may_not_use(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "tenants:\n  acme:\n    keys:\n      - sha256: " + SHA + "\n        models: [small]\n"
        "        limits: {models: {big: {tokens_per_minute: 10}}}\n"
    )
    with pytest.raises(
        ValueError, match=r"tenants.acme.keys.0.*limits.models names big, which this key may not use"
    ):
        read_keys_file(path)
    path.write_text(
        "tenants:\n  acme:\n    quota: {models: {big: {tokens_per_day: 10}}}\n    keys:\n"
        "      - sha256: " + SHA + "\n        models: [small]\n"
    )
    with pytest.raises(ValueError, match="quota.models names big, which none of the tenant's keys may use"):
        read_keys_file(path)
    path.write_text(
        "tenants:\n  acme:\n    quota: {time_zone: Moon/Base}\n    keys:\n      - sha256: " + SHA + "\n"
    )
    with pytest.raises(ValueError, match="unknown time zone 'Moon/Base'"):
        read_keys_file(path)
    path.write_text(
        "tenants:\n  acme:\n    quota: {models: {big: {tokens_per_day: 10}}}\n    keys:\n"
        "      - sha256: " + SHA + "\n        models: [small, big]\n"
        "        limits: {time_zone: Asia/Tokyo, models: {big: {budget: 2, budget_period: weekly}}}\n"
    )
    assert read_keys_file(path).tenants["acme"].keys[0].limits.models["big"].budget == 2
