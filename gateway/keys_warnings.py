"""What `ctxgate keys add` can tell is wrong before a client finds out: a model the server does not
serve (that key's every request would be 403) and a budget on a policy without prices (spend stays
0, so the budget never binds). Warnings only: the key is still written, the server may change."""

from __future__ import annotations

from pathlib import Path

from ctxgate.backend.model.model_prepare import DEFAULT_MODEL_NAME
from ctxgate.gateway.config_file import CtxgateConfig
from ctxgate.policies.loader import PolicyFileError, load_policy_file, packaged_policy_dir
from ctxgate.policies.schema import Policy

POLICY_SUFFIXES = (".yaml", ".yml")


def served_model_names(config: CtxgateConfig) -> list[str]:
    """The model names a `ctxgate serve --config` of this file answers to (as /v1/models lists them)."""
    if config.model_list:
        return [model.model_name for model in config.model_list]
    names = [config.server.served_model_name] if config.server.served_model_name else []
    if config.server.upstreams:
        return names  # the upstream's own name is only known by asking it
    model = config.engine.model
    if model in (None, "", "default"):
        names.append(DEFAULT_MODEL_NAME)
    else:
        path = Path(model)
        names.append(path.stem if path.suffix.lower() == ".gguf" else path.name)
    return names


def find_policy(name: str, config: CtxgateConfig) -> Policy | None:
    directories = [packaged_policy_dir()] if config.server.include_packaged_policies else []
    if config.server.policy_dir is not None and config.server.policy_dir.is_dir():
        directories.append(config.server.policy_dir)
    found = None
    for directory in directories:  # a later folder's policy wins, as in the server
        for path in sorted(directory.iterdir()):
            if path.suffix not in POLICY_SUFFIXES:
                continue
            try:
                policy = load_policy_file(path)
            except PolicyFileError:
                continue  # `config check` / `policy check` report it
            if policy.name == name:
                found = policy
    return found


def key_warnings(
    models: list[str] | None,
    policy_name: str | None,
    budget: float | None,
    config: CtxgateConfig,
    config_given: bool,
) -> list[str]:
    warnings = []
    served = served_model_names(config)
    source = (
        "the server config" if config_given else "a `ctxgate serve` without --config (pass --config FILE)"
    )
    for model in models or []:
        if served and model not in served:
            warnings.append(
                f"--model {model}: {source} serves {', '.join(served)}; requests with this key "
                f"will be refused (403) for every model it does not list"
            )
    name = policy_name or config.server.default_policy
    policy = find_policy(name, config)
    if policy is None:
        warnings.append(f"--policy {name}: no such policy in {source}")
    elif budget is not None and policy.cost.prompt_per_1k == 0 and policy.cost.completion_per_1k == 0:
        warnings.append(
            f"--budget {budget:g}: policy '{name}' has no prices (cost.prompt_per_1k and "
            "cost.completion_per_1k are 0), so spend stays 0 and this budget never binds"
        )
    return warnings
