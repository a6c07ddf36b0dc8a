"""docs/configuration.md's complete example (the shipped deploy/ctxgate.example.yaml) states the code's
defaults: every value equals the settings model's default, except the keys the example sets on
purpose, which the page names. A default changed in the code fails here until the page follows."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"
# The example's own choices (a deployment sets them); the page lists them by name.
EXAMPLE_CHOICES = {
    "server.served_model_name",
    "server.policy_dir",
    "server.keys_file",
    "server.index_dir",
    "server.upstreams",
    "server.redis_url",
}
# Defaults computed from the machine: the example writes null, which the model resolves the same way.
MACHINE_DEFAULTS = {"server.compression_workers"}


def _example(page: str) -> dict:
    section = page.split("## A complete example", 1)[1]
    return yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


def _sections() -> dict[str, type[BaseModel]]:
    from ctxgate.gateway.config_file import CtxgateConfig

    return {
        name: info.annotation
        for name, info in CtxgateConfig.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
    }


def not_defaults(page: str) -> dict[str, tuple[object, object]]:
    """Config key -> (the example's value, the code's default) where they differ and should not."""
    sections = _sections()
    wrong = {}
    for section, values in _example(page).items():
        model = sections[section]
        for key, value in values.items():
            path = f"{section}.{key}"
            if path in EXAMPLE_CHOICES or (path in MACHINE_DEFAULTS and value is None):
                continue
            default = model.model_fields[key].get_default(call_default_factory=True)
            if value != default:
                wrong[path] = (value, default)
    return wrong


def test_every_value_of_the_example_is_the_code_default():
    assert not_defaults(PAGE.read_text()) == {}, "example value, code default"


def test_a_stale_value_is_caught():
    stale = PAGE.read_text().replace("  drop_params: false", "  drop_params: true")
    assert not_defaults(stale) == {"server.drop_params": (True, False)}


def test_the_page_names_the_example_choices():
    text = PAGE.read_text().split("## A complete example", 1)[1].split("```", 1)[0]
    assert [path for path in EXAMPLE_CHOICES if f"`{path.split('.', 1)[1]}`" not in text] == []
