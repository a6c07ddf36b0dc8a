"""The reference pages, generated from the code so they cannot drift from it.

mkdocs loads this file as a hook (`hooks:` in mkdocs.yml): at every build `on_files` adds the pages
below, rendered from the pydantic models (policy, config file, keys file), the settings dataclasses,
the argparse parsers and the Prometheus registries of the tree being built. Nothing generated is
committed, so there is nothing to regenerate. `python docs/gen_reference.py OUT_DIR` writes the
same pages as files (to read them without a build); tests/docs/test_reference.py checks coverage.

The pages' parts are in docs/reference_gen/: describing a field, model and dataclass tables, the
CLI page and the metrics page; this file holds the pages built from the models, the hook and `main`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = Path(__file__).resolve().parent
# The tree being documented, also when mkdocs runs from elsewhere, and the generator's own parts.
for _path in (ROOT, DOCS):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from reference_gen.cli_reference import cli_page  # noqa: E402
from reference_gen.fields import table  # noqa: E402
from reference_gen.metrics_reference import metrics_page  # noqa: E402
from reference_gen.model_pages import model_sections, models_page, settings_rows  # noqa: E402

__all__ = [
    "PAGES",
    "cli_page",
    "config_page",
    "keys_page",
    "main",
    "metrics_page",
    "model_sections",
    "on_files",
    "policy_page",
    "render_all",
    "request_page",
]


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
