"""Who is asking and what they may use: the API key, the served models, the policies and retrieval
indexes a tenant may name, and its prefix-cache salt.

After `authenticate` every decision is scoped to the tenant it returns; a refusal never tells a key
what exists beyond what it may use.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

from ctxgate.backend.engine.api import EngineClient
from ctxgate.backend.openai_api.errors import APIError
from ctxgate.compression.store.index_names import InvalidIndexName, check_index_name
from ctxgate.gateway.affinity import affinity_key
from ctxgate.gateway.console.admin_key import AdminKey
from ctxgate.gateway.keys import KeyRejected, KeyStore, Tenant
from ctxgate.gateway.request_id import note_tenant
from ctxgate.gateway.settings import GatewaySettings


def index_not_found(name: str) -> APIError:
    return APIError(
        404, f"retrieval index '{name}' not found", param="ctxgate.retrieval.index", code="index_not_found"
    )


class Access:
    """Keys, served models and what each tenant may name."""

    def __init__(
        self,
        settings: GatewaySettings,
        engine: EngineClient,
        keys: KeyStore,
        admin_key: AdminKey | None = None,
    ):
        self.settings = settings
        self.engine = engine
        self.keys = keys
        self.admin_key = admin_key  # the console's: never a credential here
        # A model list: each served name's own group (its context length, whether it forwards fields).
        self.models: dict[str, EngineClient] = dict(engine.groups)
        self._prefix_chars = {model.model_name: model.affinity_prefix_chars for model in settings.model_list}
        # Keys each tenant's prefix-cache salt; random per process unless configured (replicas that
        # share an upstream should share it, or they never share cached prefixes).
        secret = settings.cache_salt_secret or secrets.token_hex(32)
        self._salt_key = secret.encode()

    def cache_salt(self, tenant: str) -> str:
        """The tenant's prefix-cache namespace: HMAC-SHA256 of its name under the server secret, so
        no client can name (or guess) another tenant's salt."""
        return hmac.new(self._salt_key, tenant.encode(), hashlib.sha256).hexdigest()

    # -- identity and models -------------------------------------------------------------------
    def engine_for(self, model: str | None) -> EngineClient:
        """The engine serving this model name (the one engine without a model list)."""
        return self.models.get(model or "", self.engine)

    def route_key(
        self,
        model: str,
        tenant: Tenant,
        messages: list[dict[str, Any]] | None,
        prompt_text: str | None,
        conversation: str | None = None,
    ) -> str | None:
        """The cache-affinity key of a request for a model-list model (None otherwise): its
        conversation's key where the policy remembers conversations (gateway/conversation.py), so
        every turn, RAG or not, goes where the earlier turns' prefix is cached."""
        if model not in self._prefix_chars:
            return None
        if conversation is not None:
            return conversation
        return affinity_key(self.cache_salt(tenant.name), messages, prompt_text, self._prefix_chars[model])

    @property
    def model_names(self) -> list[str]:
        if self.models:
            return list(self.models)
        names = [self.settings.served_model_name or self.engine.model_name]
        if self.engine.model_name not in names:
            names.append(self.engine.model_name)
        return names

    def authenticate(self, authorization: str | None, api_key_header: str | None = None) -> Tenant:
        key = api_key_header
        if authorization:
            scheme, _, credentials = authorization.partition(" ")
            key = credentials.strip() if scheme.lower() == "bearer" else None
        if self.admin_key is not None and self.admin_key.matches(key):
            raise APIError(
                401,
                "the admin key opens the console only; API routes take tenant keys",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            tenant = self.keys.authenticate(key)
        except KeyRejected as exc:
            raise APIError(
                401,
                f"{exc}; ask for a new key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            ) from None
        if tenant is not None:
            note_tenant(tenant.name)  # for the access log
        if tenant is None:
            message = "missing API key (Authorization: Bearer <key>)" if not key else "invalid API key"
            raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return tenant

    def allowed_models(self, tenant: Tenant | None) -> list[str]:
        """The served model names this tenant's key may use."""
        allowed = tenant.key.models if tenant is not None and tenant.key is not None else None
        return [name for name in self.model_names if allowed is None or name in allowed]

    def check_model(self, model: str, tenant: Tenant | None = None) -> None:
        if model not in self.model_names:
            raise APIError(
                404,
                f"model '{model}' is not served here (available: {', '.join(self.allowed_models(tenant))})",
                param="model",
                code="model_not_found",
            )
        allowed = tenant.key.models if tenant is not None and tenant.key is not None else None
        if allowed is not None and model not in allowed:
            raise APIError(
                403,
                f"API key {tenant.key.key_id} may not use model '{model}' (allowed: {', '.join(allowed)})",
                param="model",
                code="model_not_allowed",
                error_type="permission_error",
            )

    # -- what a tenant may name ----------------------------------------------------------------
    def home_policy_name(self, tenant: Tenant) -> str:
        """The policy a tenant's requests get when they name none; its quota and prices are the tenant's."""
        return tenant.policy or self.settings.default_policy

    def allowed_policies(self, tenant: Tenant) -> tuple[str, ...] | None:
        """Policy names this tenant may name (its home policy first); None: any (open mode)."""
        if not tenant.bounded:
            return None
        return tuple(dict.fromkeys((self.home_policy_name(tenant), *(tenant.policies or ()))))

    def check_policy_allowed(self, tenant: Tenant, name: str) -> None:
        allowed = self.allowed_policies(tenant)
        if allowed is None or name in allowed:
            return
        # Checked before the policy is looked up: the answer does not tell whether it exists.
        who = f"API key {tenant.key.key_id}" if tenant.key is not None else f"tenant '{tenant.name}'"
        raise APIError(
            403,
            f"{who} may not use policy '{name}' (it may use: {', '.join(allowed)})",
            param="ctxgate.policy",
            code="policy_not_allowed",
            error_type="permission_error",
        )

    def check_index(self, tenant: Tenant, name: str) -> None:
        """A well-formed name (400 otherwise) that this tenant may search. An index it may not use is
        the same 404 as one that does not exist, so a key cannot learn other tenants' index names."""
        try:
            check_index_name(name)
        except InvalidIndexName as exc:
            raise APIError(
                400, str(exc), param="ctxgate.retrieval.index", code="invalid_index_name"
            ) from None
        if tenant.indexes is not None and name not in tenant.indexes:
            raise index_not_found(name)
