"""Flags generated from settings models: names, types, choices, booleans, lists, constraints checked
while parsing, old spellings with a notice, and no default unless asked for."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import pytest
from pydantic import AfterValidator, BaseModel, Field

from ctxgate.backend.engine.config import EngineConfig, EngineServerSettings
from ctxgate.backend.settings.flags import Cli, add_model_flags, given_values
from ctxgate.gateway.settings import GatewaySettings


def _even(value: int) -> int:
    if value % 2:
        raise ValueError(f"must be even, not {value}")
    return value


class Example(BaseModel):
    max_items: Annotated[int, Cli(old=("--items",))] = Field(4, ge=1, description="how many")
    pairs: Annotated[int, AfterValidator(_even)] = Field(2, description="an even count")
    mode: Literal["fast", "exact"] = Field("fast", description="how")
    verbose: bool = Field(False, description="say more")
    urls: Annotated[list[str], Cli(old=("--url",), metavar="URL")] = Field(
        default_factory=list, description="where"
    )
    ratio: float | None = Field(None, gt=0, le=1, description="a share")
    legacy: Annotated[str | None, Cli(replacement="--mode")] = Field(None, description="the old way")


def _parser(defaults: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_model_flags(parser, Example, defaults=defaults)
    return parser


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)
    return capsys.readouterr().err


def test_each_field_becomes_a_kebab_flag_with_its_type():
    args = _parser().parse_args(
        [
            "--max-items",
            "3",
            "--mode",
            "exact",
            "--verbose",
            "--urls",
            "http://a",
            "--urls",
            "http://b",
            "--ratio",
            "0.5",
            "--pairs",
            "6",
        ]
    )
    assert given_values(args, Example) == {
        "max_items": 3,
        "pairs": 6,
        "mode": "exact",
        "verbose": True,
        "urls": ["http://a", "http://b"],
        "ratio": 0.5,
    }
    assert _parser().parse_args(["--no-verbose"]).verbose is False


def test_nothing_given_means_nothing_in_the_namespace_unless_defaults_are_asked_for():
    assert given_values(_parser().parse_args([]), Example) == {}
    filled = _parser(defaults=True).parse_args([])
    assert (filled.max_items, filled.mode, filled.verbose, filled.ratio, filled.urls) == (
        4,
        "fast",
        False,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-items", "0"], "argument --max-items/--items: Input should be greater than or equal to 1"),
        (["--max-items", "many"], "invalid int value: 'many'"),
        (["--pairs", "3"], "argument --pairs: must be even, not 3"),  # the field's own validator
        (["--ratio", "2"], "Input should be less than or equal to 1"),
        (["--mode", "slow"], "invalid choice: 'slow'"),
    ],
)
def test_a_value_the_field_refuses_is_a_usage_error(capsys, argv, message):
    assert message in _usage_error(argv, capsys)


def test_old_spellings_work_with_a_notice(capsys):
    args = _parser().parse_args(["--items", "5", "--url", "http://a", "--legacy", "x"])
    assert (args.max_items, args.urls, args.legacy) == (5, ["http://a"], "x")
    err = capsys.readouterr().err
    assert "--items is deprecated; use --max-items" in err and "--url is deprecated; use --urls" in err
    assert "--legacy is deprecated; use --mode" in err
    _parser().parse_args(["--max-items", "5"])
    assert capsys.readouterr().err == ""
    helps = {action.dest: action.help for action in _parser()._actions}
    assert "(--items: deprecated spelling)" in helps["max_items"] and helps["legacy"].startswith(
        "deprecated: use"
    )


def test_an_old_negative_bool_spelling_names_the_new_negative(capsys):
    parser = argparse.ArgumentParser()
    add_model_flags(parser, EngineConfig)
    assert parser.parse_args(["--no-prefix-caching"]).enable_prefix_caching is False
    assert "--no-prefix-caching is deprecated; use --no-enable-prefix-caching" in capsys.readouterr().err


@pytest.mark.parametrize("model", [GatewaySettings, EngineConfig, EngineServerSettings])
def test_every_setting_says_what_it_does(model):
    assert [name for name, info in model.model_fields.items() if len(info.description or "") < 10] == []
