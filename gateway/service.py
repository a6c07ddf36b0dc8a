"""The gateway's request path, independent of HTTP, as one object the routes hold (`Gateway`).

The routes (`ctxgate.gateway.routes`) parse and respond; each decision lives in the part that owns
it, in the order a request meets them:

- `access`: the API key, the served models, what a tenant may name (`ctxgate.gateway.access`);
- `resolver`: the policy the request runs under (`ctxgate.gateway.policy_resolution`);
- `preparation` (`ctxgate.gateway.prepare`): the steps before the model, in order, giving a `Prepared`
  to generation (`ctxgate.gateway.generation`): the request's `fields` and sampling
  (`ctxgate.gateway.request_fields`), its compressed and counted prompt (`prompts`,
  `ctxgate.gateway.prompt_building`), the quota check and reservation;
- `accounting`: limits, cost, reserve, reconcile, settle (`ctxgate.gateway.accounting`);
- `generation_services`: what running a prepared request needs (`ctxgate.gateway.generation`), with
  what a client is told when generation fails (`ctxgate.gateway.engine_errors`);
- `shadow`: after a sampled request answered, its uncompressed prompt answered again on idle capacity
  and compared (`ctxgate.gateway.shadow`), summarised in `shadow_ledger`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from ctxgate.backend.engine.api import EngineClient
from ctxgate.gateway.access import Access
from ctxgate.gateway.accounting import Accounting
from ctxgate.gateway.adaptive_budget import AdaptiveBudget
from ctxgate.gateway.budget_control import BudgetController
from ctxgate.gateway.console.admin_key import AdminKey
from ctxgate.gateway.engine_errors import engine_error
from ctxgate.gateway.engine_load import reader_for
from ctxgate.gateway.generation import GenerationServices
from ctxgate.gateway.keys import KeyStore
from ctxgate.gateway.metrics import GatewayMetrics
from ctxgate.gateway.policy_resolution import PolicyResolver
from ctxgate.gateway.prepare import Preparation
from ctxgate.gateway.prompt_building import Pipeline, PromptBuilder
from ctxgate.gateway.quota import QuotaStore
from ctxgate.gateway.request_fields import RequestFields
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.gateway.shadow.ledger import ShadowLedger
from ctxgate.gateway.shadow.load import load_for
from ctxgate.gateway.shadow.log import ShadowLog
from ctxgate.gateway.shadow.runner import ShadowRunner
from ctxgate.gateway.tokenizer_per_model import load_model_tokenizers
from ctxgate.policies.loader import PolicyRegistry


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        engine: EngineClient,
        tokenizer: Any,
        pipeline: Pipeline,
        policies: PolicyRegistry,
        keys: KeyStore,
        store: QuotaStore,
        metrics: GatewayMetrics,
        admin_key: AdminKey | None = None,
    ):
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.pipeline = pipeline
        self.policies = policies
        self.keys = keys
        self.store = store
        self.metrics = metrics
        # Each served model's tokenizer (model_list[].tokenizer, else this one) and neutraliser. Upstream
        # mode: the serving model's tokens (from --tokenizer) plus the common templates' ones.
        self.tokens = load_model_tokenizers(tokenizer, engine.forwards_fields, list(settings.model_list))
        self.neutraliser = self.tokens.default.neutraliser
        self.budgets = BudgetController(reader_for(engine))
        self.access = Access(settings, engine, keys, admin_key)
        self.resolver = PolicyResolver(policies, self.access)
        self.adaptive = AdaptiveBudget(self.budgets, metrics)
        self.accounting = Accounting(store, metrics, self.resolver, self.adaptive, pipeline.observe_prefill)
        self.fields = RequestFields(self.access, self.tokens, settings.drop_params)
        self.prompts = PromptBuilder(self.access, self.tokens, pipeline, metrics)
        self.preparation = Preparation(
            self.access,
            self.resolver,
            self.accounting,
            self.adaptive,
            self.fields,
            self.prompts,
            tokenizer,
            metrics,
        )
        self.shadow_ledger = ShadowLedger(recent=settings.shadow_recent)
        self.shadow = ShadowRunner(
            engine,
            self.prompts,
            load_for(engine),
            metrics.shadow,
            self.shadow_ledger,
            ShadowLog(settings.shadow_log) if settings.shadow_log is not None else None,
        )
        self.generation_services = GenerationServices(
            engine=engine,
            timeout_s=settings.request_timeout_s,
            settlement=self.accounting,
            first_token=self.budgets.first_token,
            metrics=metrics,
            engine_error=partial(engine_error, metrics=metrics),
            answered=self.shadow.after_live,
        )

    @property
    def forwards_fields(self) -> bool:
        """Upstream mode: the engine sends the client's fields on instead of honouring them itself."""
        return self.engine.forwards_fields
