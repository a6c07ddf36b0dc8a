"""`ctxgate serve --config FILE`: one YAML file for every setting the serve flags configure.

The sections are the settings models themselves: `server:` holds `GatewaySettings` fields and
`engine:` `EngineConfig` fields, each key spelled as the field (and its flag is `--` + the key with
dashes: `server.max_in_flight` <-> `--max-in-flight`); `logging.level` is `--log-level`. A key
written `null` (or left out) takes the default. String values of the form `os.environ/NAME` are
replaced by that environment variable (as in LiteLLM's proxy config), so secrets never live in the
file. Relative paths are resolved against the file's directory, so a config and its keys file can
move together. Precedence: a flag given on the command line > the file > the environment variable
a setting reads (where it has one) > the setting's default.

Keys of earlier releases (`engine.threads`, `upstreams.urls`, `redis.url`, ...) still load, with a
deprecation warning naming the key to use (`DEPRECATED_KEYS`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

from ctxgate.backend.engine.config import EngineConfig
from ctxgate.backend.settings.flags import error_text, kebab
from ctxgate.gateway.model_list_config import ModelConfig, check_model_list
from ctxgate.gateway.settings import GatewaySettings
from ctxgate.policies.suggest import field_suggestion

ENV_PREFIX = "os.environ/"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# GatewaySettings.model is the engine's model directory: the file and the flags set it once, as engine.model.
# model_list is the file's top-level `model_list:` section (no flag).
SERVER_SKIP = ("model", "model_list")

# Old key (dotted) -> the key that replaced it. One name per setting: the settings field's.
DEPRECATED_KEYS = {
    "server.reload_interval": "server.reload_interval_s",
    "server.queue_timeout": "server.queue_timeout_s",
    "server.request_timeout": "server.request_timeout_s",
    "server.drain_timeout": "server.drain_timeout_s",
    "server.body_read_timeout": "server.body_read_timeout_s",
    "keys_file": "server.keys_file",
    "policy_dir": "server.policy_dir",
    "upstreams.urls": "server.upstreams",
    "upstreams.model": "server.upstream_model",
    "upstreams.connect_timeout": "server.upstream_connect_timeout_s",
    "upstreams.read_timeout": "server.upstream_read_timeout_s",
    "upstreams.retries": "server.upstream_retries",
    "upstreams.api_key": "server.upstream_api_key",
    "redis.url": "server.redis_url",
    "logging.access_log": "server.access_log",
    "metrics.key": "server.metrics_key",
    "metrics.vllm_names": "server.vllm_metric_names",
    "engine.max_waiting_requests": "server.engine_max_waiting_requests",
    "engine.embed_on": "server.embed_on",
    "engine.threads": "engine.num_threads",
    "engine.prefix_caching": "engine.enable_prefix_caching",
}
_OLD_SECTIONS = ("upstreams", "redis", "metrics")  # emptied by the renames above
# Fields holding paths: resolved against the config file's directory when relative.
_PATH_KEYS = (
    "server.keys_file",
    "server.admin_key_file",
    "server.policy_dir",
    "server.index_dir",
    "engine.model",
)


class ConfigError(ValueError):
    """A config file that cannot be used; one line per problem, each naming the file, field and reason."""

    def __init__(self, path: str | Path | None, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        prefix = f"{path}: " if path is not None else ""
        super().__init__("\n".join(prefix + problem for problem in problems))


def _section_of(model: type[BaseModel], skip: tuple[str, ...], doc: str) -> type[BaseModel]:
    """`model`'s fields (constraints and validators included), but `skip`, as a config section."""
    fields = {name: (info.annotation, info) for name, info in model.model_fields.items() if name not in skip}
    section = create_model(
        model.__name__ + "Section", __config__=ConfigDict(extra="forbid"), __doc__=doc, **fields
    )
    return section


ServerSection = _section_of(
    GatewaySettings, SERVER_SKIP, "The gateway (`GatewaySettings`; `model` is `engine.model`)."
)


class LoggingSection(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] | None = Field(
        default=None, description="logging level (--log-level); default INFO"
    )


class CtxgateConfig(BaseModel):
    """The whole `ctxgate serve` configuration; every key is optional."""

    model_config = ConfigDict(extra="forbid")

    server: ServerSection = Field(default_factory=ServerSection, description="the gateway")  # type: ignore[valid-type]
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="the in-process engine, used when server.upstreams is empty"
    )
    logging: LoggingSection = Field(default_factory=LoggingSection, description="logging")
    model_list: Annotated[list[ModelConfig], AfterValidator(check_model_list)] = Field(
        default_factory=list,
        description="served models, each a group of deployments routed by load or cache "
        "affinity (docs/routing.md); empty: one model, the engine or server.upstreams",
    )

    def server_values(self) -> dict[str, Any]:
        """The GatewaySettings fields this file sets."""
        return {name: getattr(self.server, name) for name in self.server.model_fields_set}

    def engine_values(self) -> dict[str, Any]:
        """The EngineConfig fields this file sets."""
        return {name: getattr(self.engine, name) for name in self.engine.model_fields_set}


def key_flags() -> dict[str, str]:
    """Config key (dotted) -> the `ctxgate serve` flag that sets the same setting."""
    keys = {f"server.{name}": kebab(name) for name in ServerSection.model_fields}
    keys.update({f"engine.{name}": kebab(name) for name in EngineConfig.model_fields})
    keys["logging.level"] = "--log-level"
    return keys


# -- reading a file ------------------------------------------------------------------------------

_DROP = object()  # an interpolation that failed: the key is left out (and the problem reported)


def interpolate(
    value: Any, environ: dict[str, str] | os._Environ, where: str = "", problems: list[str] | None = None
) -> Any:
    """Replace every `os.environ/NAME` string (anywhere in the tree) with that variable's value.

    Without `problems` the first bad reference raises ConfigError; with it, each is appended there
    and its key dropped, so the rest of the file is still checked.
    """
    if isinstance(value, dict):
        items = {
            key: interpolate(item, environ, f"{where}.{key}" if where else str(key), problems)
            for key, item in value.items()
        }
        return {key: item for key, item in items.items() if item is not _DROP}
    if isinstance(value, list):
        items = [interpolate(item, environ, f"{where}.{index}", problems) for index, item in enumerate(value)]
        return [item for item in items if item is not _DROP]
    if isinstance(value, str) and value.startswith(ENV_PREFIX):
        name = value[len(ENV_PREFIX) :]
        problem = None
        if not _ENV_NAME.match(name):
            problem = f"field '{where}': '{value}' is not a valid environment reference"
        elif name not in environ:
            problem = f"field '{where}': environment variable {name} is not set"
        if problem is None:
            return environ[name]
        if problems is None:
            raise ConfigError(None, [problem])
        problems.append(problem)
        return _DROP
    return value


def _print_warning(message: str) -> None:
    print(f"ctxgate: warning: {message}", file=sys.stderr)


def _rename_deprecated(
    data: dict[str, Any], problems: list[str], warn: Callable[[str], None], where: str
) -> None:
    """Move keys of earlier releases to their current names (in place), warning for each."""
    for old, new in DEPRECATED_KEYS.items():
        old_parts, new_parts = old.split("."), new.split(".")
        owner = data.get(old_parts[0]) if len(old_parts) == 2 else data
        if not isinstance(owner, dict) or old_parts[-1] not in owner:
            continue
        value = owner.pop(old_parts[-1])
        target = data.setdefault(new_parts[0], {})
        if not isinstance(target, dict):
            continue  # the section itself is malformed: validation reports it
        if new_parts[-1] in target:
            problems.append(f"field '{old}': the deprecated name of '{new}', which is also set")
            continue
        target[new_parts[-1]] = value
        warn(f"{where}: '{old}' is deprecated; use '{new}'")
    for section in _OLD_SECTIONS:
        if data.get(section) == {}:
            del data[section]


def _drop_nulls(data: dict[str, Any]) -> None:
    """`key: null` means the default, as if the key were not written."""
    for name in list(data):
        if data[name] is None:
            del data[name]
        elif isinstance(data[name], dict):
            data[name] = {key: value for key, value in data[name].items() if value is not None}


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    for key in _PATH_KEYS:
        section, name = key.split(".")
        owner = data.get(section)
        if not isinstance(owner, dict) or not isinstance(owner.get(name), str):
            continue
        candidate = Path(owner[name]).expanduser()
        # engine.model may also be a name the loader resolves; only rewrite what exists relative to the file.
        if key == "engine.model" and not (base / candidate).exists():
            continue
        if not candidate.is_absolute():
            owner[name] = str(base / candidate)
    _resolve_model_tokenizers(data, base)


def _resolve_model_tokenizers(data: dict[str, Any], base: Path) -> None:
    """model_list[].tokenizer, when a path relative to the file (it may also be a tiktoken name)."""
    models = data.get("model_list")
    for model in models if isinstance(models, list) else []:
        spec = model.get("tokenizer") if isinstance(model, dict) else None
        if isinstance(spec, str) and not Path(spec).expanduser().is_absolute() and (base / spec).exists():
            model["tokenizer"] = str(base / spec)


def validation_problems(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """Every error of a validation, as `field 'dotted.location': reason`; an unknown field of
    `model` names its close matches ("did you mean ...?")."""
    problems = []
    for error in exc.errors(include_url=False):
        loc = ".".join(str(part) for part in error["loc"])
        reason = error_text(error)
        hint = field_suggestion(model, error["loc"]) if model and error["type"] == "extra_forbidden" else None
        problems.append(f"field '{loc}': {reason}; {hint}" if hint else f"field '{loc}': {reason}")
    return problems


def load_config(
    path: str | Path, environ: dict[str, str] | None = None, warn: Callable[[str], None] = _print_warning
) -> CtxgateConfig:
    """Read, interpolate and validate a config file. ConfigError lists every problem found (file,
    field and reason); deprecated keys are passed to `warn`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(path, [f"cannot read: {exc.strerror or exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(path, [f"invalid YAML: {exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, ["the top level must be a mapping of sections"])
    problems: list[str] = []
    data = interpolate(data, os.environ if environ is None else environ, problems=problems)
    _rename_deprecated(data, problems, warn, str(path))
    _drop_nulls(data)
    _resolve_paths(data, path.parent)
    config = None
    try:
        config = CtxgateConfig.model_validate(data)
    except ValidationError as exc:
        problems += validation_problems(exc, CtxgateConfig)
    if problems:
        raise ConfigError(path, problems)
    return config


def config_schema() -> dict[str, Any]:
    return CtxgateConfig.model_json_schema()
