"""`ctxgate serve --config FILE`: one YAML file for everything the serve flags configure.

Every key is the matching flag's name with underscores (`--max-in-flight` -> `server.max_in_flight`),
grouped in sections. String values of the form `os.environ/NAME` are replaced by that environment
variable (as in LiteLLM's proxy config), so secrets such as the Redis URL never live in the file.
Relative paths are resolved against the file's directory, so a config and its keys file can move
together. Precedence: a flag given on the command line > the file > the flag's default.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "os.environ/"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, the field and the reason."""


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid")


class ServerSection(_Section):
    host: str | None = Field(None, description="bind address (default 127.0.0.1)")
    port: int | None = Field(None, ge=1, le=65535, description="port (default 8000)")
    served_model_name: str | None = Field(None, description="the name clients send as 'model'")
    default_policy: str | None = Field(None, description="policy when neither the key nor the request names one")
    index_dir: str | None = Field(None, description="retrieval indexes built by `ctxgate index build`")
    max_body_bytes: int | None = Field(None, ge=1, description="larger request bodies get 413")
    reload_interval: float | None = Field(None, gt=0, description="seconds between policy/keys file checks")
    max_in_flight: int | None = Field(None, ge=0, description="generation requests running at once; 0: no limit")
    max_queued: int | None = Field(None, ge=0, description="requests waiting for a slot before 503s")
    queue_timeout: float | None = Field(None, gt=0, description="seconds a request may wait for a slot")
    request_timeout: float | None = Field(None, ge=0, description="seconds an admitted request may take; 0: none")
    drain_timeout: float | None = Field(None, ge=0, description="on SIGTERM, seconds for in-flight requests")
    drop_params: bool | None = Field(None, description="drop request fields the engine cannot honour instead of 400")
    tokenizer: str | None = Field(None, description="count budgets with a local HF tokenizer dir or a tiktoken "
                                  "encoding name (for a remote model)")
    compression_workers: int | None = Field(None, ge=1, description="threads that compress requests, off the "
                                            "event loop (default: one per two cores)")
    compression_nice: int | None = Field(None, ge=0, le=19, description="the compression workers' CPU priority "
                                         "below the engine's (Linux nice steps, 0-19; default 0)")
    allow_unauthenticated: bool | None = Field(None, description="serve on a non-loopback host without a keys "
                                               "file (only behind a proxy that authenticates); default false")
    body_read_timeout: float | None = Field(None, gt=0, description="seconds a client may take to send its "
                                            "request body; slower ones get 408 (default 30)")


class EngineSection(_Section):
    """The in-process engine (used when no upstreams are configured)."""

    model: str | None = Field(None, description="Hugging Face model dir (default: the packaged SmolLM2-135M)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    device: str | None = Field(None, description="auto, cpu or cuda")
    kv_cache_dtype: Literal["auto", "int8"] | None = None
    weight_quant: Literal["none", "int4"] | None = None
    block_size: int | None = Field(None, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_memory_mb: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    ttft_target_ms: float | None = Field(None, gt=0)
    threads: int | None = Field(None, ge=1)
    attention_backend: str | None = None
    prefix_caching: bool | None = Field(None, description="automatic prefix caching (default true)")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="CUDA: fraction of GPU memory")
    cuda_graphs: bool | None = Field(None, description="CUDA: decode through captured graphs (default: where they run)")
    cpu_decode_graphs: bool | None = Field(
        None, description="CPU: decode steps traced into TorchScript per batch size (default: where they run)")
    max_waiting_requests: int | None = Field(None, ge=1, description="refuse with 503 beyond this many waiting")
    embed_on: Literal["engine", "process"] | None = Field(
        None, description="where the compression embedder runs: the CPU engine's thread between its steps "
        "(default) or a child process")

    @model_validator(mode="after")
    def _one_kv_size(self) -> EngineSection:
        if self.num_kv_blocks is not None and self.kv_cache_memory_mb is not None:
            raise ValueError("set num_kv_blocks or kv_cache_memory_mb, not both")
        return self


class UpstreamsSection(_Section):
    """OpenAI-compatible servers used instead of the in-process engine, in fail-over order."""

    urls: list[str] | None = Field(None, min_length=1)
    model: str | None = Field(None, description="model name sent upstream (default: discovered)")
    connect_timeout: float | None = Field(None, gt=0)
    read_timeout: float | None = Field(None, gt=0)
    retries: int | None = Field(None, ge=0)
    api_key: str | None = Field(None, description="Bearer key sent to the upstreams, e.g. os.environ/VLLM_API_KEY")


class RedisSection(_Section):
    url: str | None = Field(None, description="shared quota ledger for replicas, e.g. os.environ/REDIS_URL")


class LoggingSection(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] | None = None
    access_log: bool | None = Field(None, description="one line per request: method, path, status, duration, "
                                    "request id, tenant (never keys or prompts); default false")


class MetricsSection(_Section):
    vllm_names: bool | None = Field(None, description="also export the engine's metrics under vLLM's vllm: names")
    key: str | None = Field(None, description="Bearer token /metrics requires, e.g. os.environ/CTXGATE_METRICS_KEY "
                            "(unset: /metrics is open)")


class CtxgateConfig(_Section):
    """The whole `ctxgate serve` configuration; every field is optional."""

    server: ServerSection = ServerSection()
    engine: EngineSection = EngineSection()
    upstreams: UpstreamsSection = UpstreamsSection()
    redis: RedisSection = RedisSection()
    keys_file: str | None = Field(None, description="keys file (YAML); without it the gateway is open")
    policy_dir: str | None = Field(None, description="directory of policy YAML files, watched for edits")
    logging: LoggingSection = LoggingSection()
    metrics: MetricsSection = MetricsSection()

    def flag_values(self) -> dict[str, Any]:
        """The values this file sets, keyed by the serve parser's argparse `dest` names."""
        values: dict[str, Any] = {}
        values.update(self.server.model_dump(exclude_none=True))
        engine = self.engine.model_dump(exclude_none=True)
        if "prefix_caching" in engine:
            values["no_prefix_caching"] = not engine.pop("prefix_caching")
        values.update(engine)
        upstreams = self.upstreams.model_dump(exclude_none=True)
        for key, dest in (("urls", "upstream"), ("model", "upstream_model"), ("connect_timeout",
                          "upstream_connect_timeout"), ("read_timeout", "upstream_read_timeout"),
                          ("retries", "upstream_retries"), ("api_key", "upstream_api_key")):
            if key in upstreams:
                values[dest] = upstreams[key]
        if self.redis.url is not None:
            values["redis_url"] = self.redis.url
        if self.keys_file is not None:
            values["keys"] = self.keys_file
        if self.policy_dir is not None:
            values["policy_dir"] = self.policy_dir
        if self.logging.level is not None:
            values["log_level"] = self.logging.level
        if self.logging.access_log is not None:
            values["access_log"] = self.logging.access_log
        if self.metrics.vllm_names is not None:
            values["vllm_metric_names"] = self.metrics.vllm_names
        if self.metrics.key is not None:
            values["metrics_key"] = self.metrics.key
        return values


# Fields holding paths: resolved against the config file's directory when relative.
_PATH_FIELDS = (("keys_file",), ("policy_dir",), ("server", "index_dir"), ("engine", "model"))


def interpolate(value: Any, environ: dict[str, str] | os._Environ, where: str = "") -> Any:
    """Replace every `os.environ/NAME` string (anywhere in the tree) with that variable's value."""
    if isinstance(value, dict):
        return {key: interpolate(item, environ, f"{where}.{key}" if where else str(key))
                for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ, f"{where}.{index}") for index, item in enumerate(value)]
    if isinstance(value, str) and value.startswith(ENV_PREFIX):
        name = value[len(ENV_PREFIX):]
        if not _ENV_NAME.match(name):
            raise ConfigError(f"field '{where}': '{value}' is not a valid environment reference")
        if name not in environ:
            raise ConfigError(f"field '{where}': environment variable {name} is not set")
        return environ[name]
    return value


def load_config(path: str | Path, environ: dict[str, str] | None = None) -> CtxgateConfig:
    """Read, interpolate and validate a config file; ConfigError says file, field and reason."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    try:
        data = interpolate(data, os.environ if environ is None else environ)
        config = CtxgateConfig.model_validate(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise ConfigError(f"{path}: field '{loc}': {first['msg']}") from None
    return _resolve_paths(config, path.parent)


def _resolve_paths(config: CtxgateConfig, base: Path) -> CtxgateConfig:
    for location in _PATH_FIELDS:
        owner: Any = config
        for part in location[:-1]:
            owner = getattr(owner, part)
        value = getattr(owner, location[-1])
        if value is None:
            continue
        candidate = Path(value).expanduser()
        # engine.model may also be a name the loader resolves; only rewrite what exists relative to the file.
        if location == ("engine", "model") and not (base / candidate).exists():
            continue
        if not candidate.is_absolute():
            setattr(owner, location[-1], str(base / candidate))
    return config


def config_schema() -> dict[str, Any]:
    return CtxgateConfig.model_json_schema()


# -- flag precedence ---------------------------------------------------------------------------
def defer_defaults(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Make every optional flag's default SUPPRESS and return the real defaults.

    After parsing, a dest present in the namespace was given on the command line; `layer` then fills
    the rest from the config file and, failing that, from these defaults.
    """
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", argparse.SUPPRESS):
            continue
        if action.default is not argparse.SUPPRESS:
            defaults[action.dest] = action.default
            action.default = argparse.SUPPRESS
    return defaults


def exclusive_groups(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The dests of each mutually exclusive group (e.g. --num-kv-blocks / --kv-cache-memory-mb)."""
    return [[action.dest for action in group._group_actions] for group in parser._mutually_exclusive_groups]


def layer(args: argparse.Namespace, defaults: dict[str, Any], file_values: dict[str, Any],
          exclusive: list[list[str]] = ()) -> list[str]:
    """Fill `args` in place: command line > file > default. Returns the dests taken from the file.

    A flag given from a mutually exclusive group also overrides the file's value for the others.
    """
    file_values = dict(file_values)
    for group in exclusive:
        if any(hasattr(args, dest) for dest in group):
            for dest in group:
                file_values.pop(dest, None)
    from_file = []
    for dest, default in defaults.items():
        if hasattr(args, dest):
            continue
        if dest in file_values:
            setattr(args, dest, file_values[dest])
            from_file.append(dest)
        else:
            setattr(args, dest, default)
    return from_file
