"""The reference pages, generated from the code so they cannot drift from it.

mkdocs loads this file as a hook (`hooks:` in mkdocs.yml): at every build `on_files` adds the pages
below, rendered from the pydantic models (policy, config file, keys file), the settings dataclasses,
the argparse parsers and the Prometheus registries of the tree being built. Nothing generated is
committed, so there is nothing to regenerate. `python docs/gen_reference.py OUT_DIR` writes the
same pages as files (to read them without a build); tests/docs/test_reference.py checks coverage.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, Literal
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the tree being documented, also when mkdocs runs from elsewhere
    sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

# -- describing one field ------------------------------------------------------------------------


def field_comments(cls: type) -> dict[str, str]:
    """The comments written above (or beside) each annotated attribute of a class, by name.

    Dataclasses and many pydantic fields carry their help as comments; this reads them from the
    source, so the reference says what the code's reader is told.
    """
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    source = textwrap.dedent("".join(lines))
    lines = source.splitlines()
    comments: dict[str, str] = {}
    class_node = ast.parse(source).body[0]
    for node in getattr(class_node, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        index = node.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#"):
            above.insert(0, lines[index].strip().lstrip("#").strip())
            index -= 1
        beside = _trailing_comment(lines[node.end_lineno - 1])
        text = " ".join(part for part in (*above, beside) if part)
        if text:
            comments[node.target.id] = text
    return comments


def _trailing_comment(line: str) -> str:
    # A '#' outside quotes starts the comment (enough for the one-line field declarations here).
    quote = None
    for position, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#":
            return line[position + 1 :].strip()
    return ""


def type_text(annotation: Any) -> str:
    """A reader's name for a type: `int or null`, `one of "a", "b"`, `list of str`."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_text(arg) for arg in args)
    if origin is Literal:
        return "one of " + ", ".join(f'"{arg}"' if isinstance(arg, str) else repr(arg) for arg in args)
    if origin is list:
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}" if args else "map"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is datetime:
        return "date-time"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


_CONSTRAINT_ATTRS = (
    ("ge", ">="),
    ("gt", ">"),
    ("le", "<="),
    ("lt", "<"),
    ("min_length", "length >="),
    ("max_length", "length <="),
    ("pattern", "matches"),
    ("multiple_of", "multiple of"),
)


def constraints_text(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for attr, word in _CONSTRAINT_ATTRS:
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
    return ", ".join(parts)


def default_text(value: Any) -> str:
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _factory_default(factory: Callable[[], Any] | None) -> str:
    # Only empty containers are evaluated: other factories read the environment or the machine,
    # which would put the build host's values (or secrets) into the docs.
    if factory in (list, dict):
        return repr(factory())
    return "set at start-up (see description)"


@dataclasses.dataclass
class Row:
    name: str
    type: str
    default: str
    constraints: str = ""
    description: str = ""
    extra: str = ""  # a page-specific column (the CLI flag of a config key)


def _cell(text: str, code: bool = False) -> str:
    if not text:
        return ""
    if code:
        return f"`{text}`"
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row], extra_header: str | None = None) -> str:
    header = ["Field", "Type", "Default", "Constraints", "Description"]
    if extra_header:
        header.insert(3, extra_header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [_cell(row.name, True), _cell(row.type), _cell(row.default, True)]
        if extra_header:
            cells.append(_cell(row.extra, True))
        cells += [_cell(row.constraints, True), _cell(row.description)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- pydantic models -----------------------------------------------------------------------------


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The model a field holds (directly, in a list, a map or an Optional) and the path suffix."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args:
        inner = _nested_model(args[0])
        return (inner[0], "[]" + inner[1]) if inner else None
    if origin is dict and len(args) == 2:
        inner = _nested_model(args[1])
        return (inner[0], ".<name>" + inner[1]) if inner else None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            inner = _nested_model(arg)
            if inner:
                return inner
    return None


def model_rows(model: type[BaseModel], prefix: str = "") -> list[Row]:
    comments = field_comments(model)
    rows = []
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            default = _factory_default(info.default_factory)
        else:
            default = default_text(info.default)
        rows.append(
            Row(
                name=prefix + name,
                type=type_text(info.annotation),
                default=default,
                constraints=constraints_text(info.metadata),
                description=info.description or comments.get(name, ""),
            )
        )
    return rows


def model_sections(
    model: type[BaseModel], prefix: str = ""
) -> Iterator[tuple[str, type[BaseModel], list[Row]]]:
    """(path, model, rows) for a model and, depth first, every model nested in its fields."""
    yield prefix.rstrip("."), model, model_rows(model, prefix)
    for name, info in model.model_fields.items():
        nested = _nested_model(info.annotation)
        if nested:
            yield from model_sections(nested[0], f"{prefix}{name}{nested[1]}.")


def _model_doc(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    inherited = any(doc == inspect.getdoc(base) for base in model.__mro__[1:] if base is not model)
    return "" if inherited else doc


def models_page(
    title: str,
    intro: str,
    root: type[BaseModel],
    root_label: str,
    extra: Callable[[str], str] | None = None,
    extra_header: str | None = None,
) -> str:
    out = [f"# {title}\n\n", intro.strip() + "\n"]
    for path, model, rows in model_sections(root):
        out.append(f"\n## `{path}`\n\n" if path else f"\n## {root_label}\n\n")
        doc = _model_doc(model)
        if doc:
            out.append(doc + "\n\n")
        fields = [
            row
            for row in rows
            if row.type != "section" and not row.type.startswith(("list of section", "map of str to section"))
        ]
        nested = [row.name for row in rows if row not in fields]
        if extra:
            for row in fields:
                row.extra = extra(row.name)
        if fields:
            out.append(table(fields, extra_header))
        if nested:
            out.append("\nSections: " + ", ".join(f"`{name}`" for name in nested) + " (below).\n")
    return "".join(out)


# -- dataclasses ---------------------------------------------------------------------------------


def dataclass_rows(cls: type) -> list[Row]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows = []
    for item in dataclasses.fields(cls):
        if item.default is not dataclasses.MISSING:
            default = default_text(item.default)
        else:
            default = _factory_default(item.default_factory)
        rows.append(
            Row(
                name=item.name,
                type=type_text(hints.get(item.name, item.type)),
                default=default,
                description=item.metadata.get("help") or comments.get(item.name, ""),
            )
        )
    return rows


def settings_rows(cls: type) -> list[Row]:
    """Rows for a settings class, whether a dataclass or a pydantic model."""
    if inspect.isclass(cls) and issubclass(cls, BaseModel):
        return model_rows(cls)
    return dataclass_rows(cls)


# -- pages ---------------------------------------------------------------------------------------


def policy_page() -> str:
    from ctxgate.policies.schema import Policy

    intro = """
Every field of a policy file, from the pydantic models in `policies/schema.py` (this page is
generated from them at build time). Nested sections are written as YAML mappings; a request's
`overrides` and a policy's `allow_request_overrides` name fields by their dotted path
(`documents.max_tokens`). Unknown keys are errors. `ctxgate policy check FILE` validates a file and
`ctxgate policy schema` prints the JSON Schema. How to write one: [Policies](../policies.md).
"""
    return models_page("Policy reference", intro, Policy, "Top level")


def config_page() -> str:
    from ctxgate.backend.engine.config import EngineConfig
    from ctxgate.gateway.config_file import DEPRECATED_KEYS, CtxgateConfig, key_flags
    from ctxgate.gateway.settings import GatewaySettings

    flags = key_flags()
    intro = """
Every key of the `ctxgate serve --config FILE` YAML file (generated at build time). The `server:`
section is the gateway's settings (`GatewaySettings`, `gateway/settings.py`) and `engine:` the
in-process engine's (`EngineConfig`, `backend/engine/config.py`): each key is the setting's name, and the
*Flag* column is the `ctxgate serve` flag that sets the same value (the name with dashes). Every key
is optional; `null` or leaving it out means the *Default*. A flag given on the command line
overrides the file, and any value written `os.environ/NAME` is read from that environment variable.
How the file works, and a complete example: [Configuration](../configuration.md).
"""
    out = [
        models_page(
            "Configuration reference",
            intro,
            CtxgateConfig,
            "Top level",
            extra=lambda name: flags.get(name, ""),
            extra_header="Flag",
        )
    ]
    out.append("""
## Keys of earlier releases

Still accepted, with a warning naming the key to use instead.

""")
    out.append("| Old key | Key |\n| --- | --- |\n")
    out.append("".join(f"| `{old}` | `{new}` |\n" for old, new in DEPRECATED_KEYS.items()))
    out.append("""
## Gateway settings (`GatewaySettings`)

The same settings as the code sees them: the names used by code and tests that build a gateway
directly (`create_app(GatewaySettings(...))`). `model` is set from `engine.model` (`--model`).

""")
    out.append(table(settings_rows(GatewaySettings)))
    out.append("""
## Engine settings (`EngineConfig`)

The built-in engine's configuration, built from the `engine:` section or the engine flags of
`ctxgate serve`, `ctxgate engine serve` and `ctxgate bench engine`.

""")
    out.append(table(settings_rows(EngineConfig)))
    return "".join(out)


def keys_page() -> str:
    from ctxgate.gateway.keys import KeysFile

    intro = """
The keys file's format, from the pydantic models in `gateway/keys.py` (generated at build time).
`ctxgate keys add|list|rotate|revoke` edit it; running gateways re-read it within
`server.reload_interval_s`. Keys are stored only as their sha256. `<name>` is a tenant's name and
`[]` an item of a list. How keys, tenants and limits work: [Keys and quotas](../keys-and-quotas.md).
"""
    return models_page("Keys file reference", intro, KeysFile, "Top level")


def request_page() -> str:
    from ctxgate.gateway.schemas import CtxgateExtras

    intro = """
The `ctxgate` object a request may carry beside the OpenAI fields (`extra_body={"ctxgate": {...}}`
in the OpenAI SDK), from `gateway/schemas.py` (generated at build time). Unknown keys are a 400
naming the field. How it is used: [API](../api.md#the-ctxgate-extension).
"""
    return models_page("Request extension reference", intro, CtxgateExtras, "`ctxgate`")


# -- CLI -----------------------------------------------------------------------------------------


def build_cli_parser() -> argparse.ArgumentParser:
    """The `ctxgate` root parser, built with an empty environment: some defaults read environment
    variables (`--redis-url`, API keys), and the build host's values must not reach the docs."""
    from ctxgate.cli import build_parser

    with mock.patch.dict(os.environ, {}, clear=True):
        return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _subparser(parser: argparse.ArgumentParser, path: list[str]) -> argparse.ArgumentParser:
    for name in path:
        parser = _subparsers(parser).choices[name]
    return parser


def cli_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """(command path, help, parser) for the root and every subcommand, depth first."""
    yield path, parser.description or "", parser
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {choice.dest: choice.help or "" for choice in sub._choices_actions}
    for name, child in sub.choices.items():
        if child is parser:
            continue
        for child_path, child_help, grandchild in cli_commands(child, (*path, name)):
            yield child_path, child_help or helps.get(name, ""), grandchild


def cli_option_rows(parser: argparse.ArgumentParser) -> list[Row]:
    deferred = parser.get_default("flag_defaults") or {}  # serve applies defaults after its config file
    formatter = argparse.HelpFormatter(parser.prog)
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        default = action.default
        if default is argparse.SUPPRESS:
            default = deferred.get(action.dest, argparse.SUPPRESS)
        if action.option_strings:
            name = ", ".join(action.option_strings)
        else:
            name = action.metavar or action.dest
        help_text = action.help or ""
        if "%" in help_text:
            help_text = formatter._expand_help(action)
        deprecated = getattr(action, "deprecated", ())
        if deprecated:
            help_text += f" ({', '.join(deprecated)}: deprecated spelling)"
        value = ""
        if action.choices:
            value = "one of " + ", ".join(str(choice) for choice in action.choices)
        elif action.nargs == 0:
            value = "switch"
        elif action.option_strings:
            value = action.metavar if isinstance(action.metavar, str) else _type_word(action.type)
            if isinstance(action, argparse._AppendAction):
                value += " (repeatable)"
        else:
            value = "positional" + (" (one or more)" if action.nargs == "+" else "")
        shown_default = (
            ""
            if default is argparse.SUPPRESS or (default in (None, False, []) and action.option_strings)
            else default_text(default)
        )
        rows.append(Row(name=name, type=value, default=shown_default, description=help_text))
    return rows


def _type_word(kind: Any) -> str:
    if kind is None or kind is str:
        return "text"
    return {int: "integer", float: "number"}.get(kind, getattr(kind, "__name__", "value"))


def cli_page() -> str:
    root = build_cli_parser()
    out = [
        "# CLI reference\n\n",
        "Every `ctxgate` command and flag, from the argparse parsers (`ctxgate/cli.py` and each "
        "package's `cli.py`; generated at build time). `ctxgate COMMAND --help` prints the same. "
        "Defaults that come from environment variables are named in the flag's help.\n",
    ]
    for path, help_text, parser in cli_commands(root):
        command = " ".join(("ctxgate", *path))
        out.append(f"\n## `{command}`\n\n")
        if help_text:
            out.append(help_text[0].upper() + help_text[1:].rstrip(".") + ".\n\n")
        rows = cli_option_rows(parser)
        sub = _subparsers(parser)
        if sub is not None:
            out.append("Subcommands: " + ", ".join(f"`{command} {name}`" for name in sub.choices) + ".\n\n")
        if rows:
            lines = ["| Argument | Value | Default | Description |", "| --- | --- | --- | --- |"]
            for row in rows:
                lines.append(
                    f"| {_cell(row.name, True)} | {_cell(row.type)} | {_cell(row.default, True)} | "
                    f"{_cell(row.description)} |"
                )
            out.append("\n".join(lines) + "\n")
    return "".join(out)


# -- metrics -------------------------------------------------------------------------------------


@dataclasses.dataclass
class MetricDoc:
    name: str  # as exported (counters with _total)
    type: str
    labels: tuple[str, ...]
    help: str


def _exported_name(name: str, kind: str) -> str:
    if kind == "counter" and not name.endswith("_total"):
        return name + "_total"
    if kind == "info" and not name.endswith("_info"):
        return name + "_info"
    return name


_SERIES_LABELS = {"le", "quantile"}  # a histogram's or summary's own, not the metric's


def registry_metrics(registry: Any, owners: tuple[Any, ...] = ()) -> list[MetricDoc]:
    """Every metric a registry exports. Label names come from the metric objects (a labelled metric
    has no series until first used); collectors that build families at scrape time give theirs."""
    from prometheus_client.metrics import MetricWrapperBase

    docs: dict[str, MetricDoc] = {}
    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, MetricWrapperBase):
                name = _exported_name(value._name, value._type)
                docs[name] = MetricDoc(name, value._type, tuple(value._labelnames), value._documentation)
    for family in registry.collect():
        name = _exported_name(family.name, family.type)
        if name in docs:
            continue
        labels = sorted({label for sample in family.samples for label in sample.labels} - _SERIES_LABELS)
        docs[name] = MetricDoc(name, family.type, tuple(labels), family.documentation)
    return sorted(docs.values(), key=lambda doc: doc.name)


def metric_groups() -> list[tuple[str, str, list[MetricDoc]]]:
    """(title, note, metrics) per source, each built on a fresh registry of its own."""
    from ctxgate.backend.engine.metrics import VLLM_PREFIX, EngineMetrics, export_vllm_names
    from ctxgate.backend.routing.upstream import UpstreamClient, UpstreamConfig
    from ctxgate.gateway.admission import AdmissionCollector, AdmissionController
    from ctxgate.gateway.metrics import GatewayMetrics

    gateway = GatewayMetrics()
    gateway.registry.register(AdmissionCollector(AdmissionController(64, 64, 10.0)))
    all_gateway = registry_metrics(gateway.registry, (gateway, gateway.shadow))
    process = [doc for doc in all_gateway if not doc.name.startswith("ctxgate:")]
    own = [doc for doc in all_gateway if doc.name.startswith("ctxgate:")]

    upstream_client = UpstreamClient(UpstreamConfig(urls=["http://engine:8001"]))
    upstream = registry_metrics(upstream_client.metrics.registry, (upstream_client.metrics,))

    from ctxgate.backend.routing.deployment_metrics import DeploymentMetrics, DeploymentState

    deployment_metrics = DeploymentMetrics()
    deployment_metrics.watch(lambda: [DeploymentState("chat", "http://engine-1:8001/v1", 0, True)])
    deployments = registry_metrics(deployment_metrics.registry, (deployment_metrics,))

    engine = EngineMetrics("model")
    plain = {doc.name for doc in registry_metrics(engine.registry, (engine,))}
    export_vllm_names(engine)
    everything = registry_metrics(engine.registry, (engine,))
    engine_docs = [doc for doc in everything if doc.name in plain]
    vllm = [doc for doc in everything if doc.name.startswith(VLLM_PREFIX)]
    return [
        (
            "Gateway",
            "Requests, compression, tokens, spend, quotas, policies and admission "
            "(`gateway/metrics.py`, `gateway/admission.py`).",
            own,
        ),
        (
            "Upstreams",
            "In upstream mode, per upstream URL (credentials removed from the label) "
            "(`backend/routing/upstream_metrics.py`).",
            upstream,
        ),
        (
            "Model groups",
            "With a `model_list`, per served model and deployment (a URL without credentials, or "
            "`builtin`) (`backend/routing/deployment_metrics.py`; [Routing](../routing.md)).",
            deployments,
        ),
        (
            "Engine",
            "The built-in engine, on the gateway's `/metrics` (in-process engine) and on "
            "`ctxgate engine serve`'s (`backend/engine/metrics.py`).",
            engine_docs,
        ),
        (
            "vLLM names",
            "With `metrics.vllm_names` (or `--vllm-metric-names`), the engine's "
            "vLLM-compatible metrics are exported a second time under vLLM's names, so dashboards and "
            "autoscalers written for vLLM work unchanged.",
            vllm,
        ),
        ("Process", "The gateway process's own (prometheus-client's standard collectors).", process),
    ]


def metrics_page() -> str:
    out = [
        "# Metrics reference\n\n",
        "Every Prometheus metric on `/metrics`, read from the metric registries the gateway and "
        "the engine build (generated at build time). Counters are listed with their `_total` "
        "suffix and histograms by their base name (`_bucket`, `_sum` and `_count` series); "
        "prometheus-client also exports a `_created` timestamp beside each counter and histogram "
        "(`PROMETHEUS_DISABLE_CREATED_SERIES=True` turns those off). "
        "Dashboards and alerts: [Deploying](../deploying.md#metrics-logs-and-the-dashboard).\n",
    ]
    for title, note, docs in metric_groups():
        out.append(
            f"\n## {title}\n\n{note}\n\n| Metric | Type | Labels | Help |\n| --- | --- | --- | --- |\n"
        )
        for doc in docs:
            labels = ", ".join(f"`{label}`" for label in doc.labels)
            out.append(f"| `{doc.name}` | {doc.type} | {labels} | {_cell(doc.help)} |\n")
    return "".join(out)


PAGES: dict[str, Callable[[], str]] = {
    "reference/policy.md": policy_page,
    "reference/config.md": config_page,
    "reference/keys.md": keys_page,
    "reference/request.md": request_page,
    "reference/cli.md": cli_page,
    "reference/metrics.md": metrics_page,
}


def render_all() -> dict[str, str]:
    return {uri: build() for uri, build in PAGES.items()}


# -- mkdocs hook ---------------------------------------------------------------------------------


def on_files(files, config):  # noqa: ANN001, ANN201 - mkdocs' hook signature
    from mkdocs.structure.files import File

    for uri, content in render_all().items():
        existing = files.get_file_from_path(uri)
        if existing is not None:  # a stale written-out copy must not shadow the generated page
            files.remove(existing)
        files.append(File.generated(config, uri, content=content))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the generated reference pages as files")
    parser.add_argument("out_dir", type=Path, help="directory to write reference/*.md into")
    args = parser.parse_args(argv)
    for uri, content in render_all().items():
        path = args.out_dir / uri
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
