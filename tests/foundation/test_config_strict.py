"""A typo in the config file is an error, one line with the closest name: it was silently ignored
(`sandbox: {max_concurency: 3}` ran with the default concurrency, `sandboxx:` with none of it)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, NoReturn

import pytest
from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import SettingsConfigDict
from typer.testing import CliRunner

from sandboxd.settings import SandboxSettings
from toolenv.cli import build_app
from toolenv_core.config import ConfigFileError, ServiceSettings, check_sections, config_error
from toolenv_core.errors import problems

ROOT = Path(__file__).resolve().parents[2]
KEY_SAID = (
    "invalid sandbox settings: max_concurency: unknown setting (did you mean max_concurrency?)"
)
SECTION_SAID = (
    "unknown config section 'sandboxx' (did you mean sandbox?); "
    "known: emulators, gateway, ray, rollout, sandbox, traces"
)


def _never_started(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("a server started on a config file with a typo")


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `serve` command stops before its server: a test fails rather than hangs."""
    monkeypatch.setattr("uvicorn.run", _never_started)
    monkeypatch.setattr("toolenv_core.serving.serve", _never_started)  # sandboxd, emulators
    monkeypatch.setattr("toolenv.wiring.run_gateway", _never_started)


def _invoke(args: list[str], **env: str | None):
    return CliRunner().invoke(build_app(), args, env={"TOOLENV_CONFIG": None, **env})


@pytest.mark.parametrize(
    "command",
    [
        ["config", "show"],
        ["serve", "--port", "1"],
        ["gateway", "serve", "--mode", "proxy", "--port", "1"],
        ["sandboxd", "serve", "--insecure-no-isolation"],
    ],
)
@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_a_typo_in_a_section_key_is_one_line_with_the_closest_setting(
    tmp_path: Path, command: list[str], suffix: str, no_server: None
) -> None:
    cfg = tmp_path / f"toolenv{suffix}"
    cfg.write_text(
        "[sandbox]\nmax_concurency = 3\n"
        if suffix == ".toml"
        else "sandbox:\n  max_concurency: 3\n"
    )
    result = _invoke([*command, "--config", str(cfg)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"error: {KEY_SAID}\n"


def test_every_service_refuses_an_unknown_key_in_its_own_section(
    tmp_path: Path, no_server: None
) -> None:
    cfg = tmp_path / "toolenv.yaml"
    cases = [
        (["config", "show"], "gateway:\n  hedgeing: true\n", "invalid gateway settings: hedgeing"),
        (
            ["emulators", "serve", "--config", str(cfg)],
            "emulators:\n  sead: 3\n",
            "invalid emulators settings: sead: unknown setting (did you mean seed?)",
        ),
        (
            ["rollout", "settings"],  # the rollout CLI names the field alone, as for any value
            "rollout:\n  tool_timout_s: 3\n",
            "tool_timout_s: unknown setting (did you mean tool_timeout_s?)",
        ),
        (
            ["config", "show"],
            "ray:\n  adress: auto\n",
            "invalid ray settings: adress: unknown setting (did you mean address?)",
        ),
        (
            ["config", "show"],
            "traces:\n  cache_dri: /tmp\n",
            "invalid traces settings: cache_dri: unknown setting (did you mean cache_dir?)",
        ),
    ]
    for args, text, said in cases:
        cfg.write_text(text)
        result = _invoke(args, TOOLENV_CONFIG=str(cfg))
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert result.stderr.startswith(f"error: {said}"), (args, result.stderr)
        assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("command", [["config", "show"], ["gateway", "serve", "--port", "1"]])
def test_a_typo_in_a_tools_table_entry_is_one_line_with_the_closest_setting(
    tmp_path: Path, command: list[str], no_server: None
) -> None:
    """It said "Extra inputs are not permitted", with no setting named, unlike a section's typo."""
    said = (
        "error: invalid gateway settings: tools.0.retry.max_atempts: unknown setting (did you "
        "mean max_attempts?); tools.0.concurency: unknown setting (did you mean concurrency?); "
        "tools.0.zzz: unknown setting\n"
    )
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(
        "gateway:\n  tools:\n    - {name: search, kind: search, concurency: 3, zzz: 1,\n"
        "       retry: {enabled: true, max_atempts: 2}}\n"
    )
    result = _invoke([*command, "--config", str(cfg)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == said
    tools = '[{"name": "search", "kind": "search", "concurency": 3, "zzz": 1, '
    tools += '"retry": {"enabled": true, "max_atempts": 2}}]'
    result = _invoke(command, TOOLENV_GATEWAY_TOOLS=tools)
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == said


@pytest.mark.parametrize(
    "command", [["config", "show"], ["serve", "--port", "1"], ["gateway", "serve", "--port", "1"]]
)
def test_an_unknown_section_is_one_line_naming_the_known_ones(
    tmp_path: Path, command: list[str], no_server: None
) -> None:
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("sandboxx:\n  max_concurrency: 3\n")
    result = _invoke([*command, "--config", str(cfg)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"error: {SECTION_SAID}\n"


@pytest.mark.parametrize("command", [["config", "show"], ["sandboxd", "serve"]])
# a falsy one (`0`, `false`, `[]`, `""`) was read as an empty section: its defaults, not a word
@pytest.mark.parametrize("body", ["\n  - max_concurrency", " 0", " false", " []", ' ""'])
def test_a_section_that_is_not_a_mapping_is_one_line(
    tmp_path: Path, command: list[str], body: str, no_server: None
) -> None:
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(f"sandbox:{body}\n")
    result = _invoke([*command, "--config", str(cfg)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == "error: config section 'sandbox' must be a mapping\n"


def test_the_compose_config_loads_and_the_same_file_with_a_typo_does_not(tmp_path: Path) -> None:
    text = (ROOT / "compose" / "toolenv.yaml").read_text()
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(text)
    shown = _invoke(["config", "show", "--json", "--config", str(cfg)])
    assert shown.exit_code == 0, (shown.output, shown.exception)
    cfg.write_text(text.replace("gateway:", "gatway:", 1))
    typo = _invoke(["config", "show", "--config", str(cfg)])
    assert typo.exit_code == 2, (typo.output, typo.exception)
    assert typo.stderr.startswith("error: unknown config section 'gatway' (did you mean gateway?)")


def test_a_stray_env_var_is_ignored_but_the_same_key_in_the_file_is_not(tmp_path: Path) -> None:
    """Shells carry stray `TOOLENV_*` variables: only the file, which the user wrote for toolenv,
    is held to its names."""
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("sandbox:\n  max_concurrency: 3\n")
    stray = {"TOOLENV_SANDBOX_MAX_CONCURENCY": "7", "TOOLENV_SANDBOX_NO__SUCH": "1"}
    shown = _invoke(["config", "show", "--json", "--config", str(cfg)], **stray)
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert '"max_concurrency": 3' in shown.stdout
    cfg.write_text("sandbox:\n  max_concurency: 3\n")
    typo = _invoke(["config", "show", "--config", str(cfg)], **stray)
    assert (typo.exit_code, typo.stderr) == (2, f"error: {KEY_SAID}\n")


def test_the_settings_class_names_every_unknown_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLENV_SANDBOX_MAX_CONCURENCY", "7")  # ignored, as before
    assert SandboxSettings.from_sections({"sandbox": {"max_concurrency": 3}}).max_concurrency == 3
    with pytest.raises(ValidationError) as caught:
        SandboxSettings.from_sections({"sandbox": {"max_concurency": 3, "zzz": 1}})
    assert problems(caught.value) == [
        ("max_concurency", "unknown setting (did you mean max_concurrency?)"),
        ("zzz", "unknown setting"),
    ]
    assert config_error(caught.value) == f"{KEY_SAID}; zzz: unknown setting"


class _Aliased(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLENV_ALIASED_")
    section: ClassVar[str] = "aliased"
    workers: int = Field(default=1, validation_alias=AliasChoices("workers", "num_workers"))


def test_a_field_alias_is_a_known_key() -> None:
    assert _Aliased.from_sections({"aliased": {"num_workers": 4}}).workers == 4
    with pytest.raises(ValidationError, match="did you mean num_workers"):
        _Aliased.from_sections({"aliased": {"num_worker": 4}})


def test_check_sections_suggests_the_closest_and_lists_the_known() -> None:
    check_sections({"gateway": {}}, ["gateway", "sandbox"])
    with pytest.raises(ConfigFileError) as caught:
        check_sections({"sandboxx": {}, "zzz": {}}, ["gateway", "sandbox"])
    assert str(caught.value) == (
        "unknown config sections 'sandboxx' (did you mean sandbox?), 'zzz'; known: gateway, sandbox"
    )


@pytest.mark.parametrize(
    ("command", "section", "said"),
    [
        (["sandboxd", "settings"], "sandbox:\n  max_concurency: 3\n", KEY_SAID),
        (
            ["emulators", "settings"],
            "emulators:\n  sead: 3\n",
            "invalid emulators settings: sead: unknown setting (did you mean seed?)",
        ),
        (
            ["traces", "list"],
            "traces:\n  sourc: x\n",
            "invalid traces settings: sourc: unknown setting (did you mean source?)",
        ),
        (
            ["traces", "fetch", "search_r1"],
            "traces:\n  sourc: x\n",
            "invalid traces settings: sourc: unknown setting (did you mean source?)",
        ),
    ],
)
def test_the_settings_and_traces_commands_say_a_bad_config_in_one_line(
    tmp_path: Path, command: list[str], section: str, said: str
) -> None:
    """They printed a pydantic traceback for the same file `config show` refuses in one line."""
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(section)
    result = _invoke(command, TOOLENV_CONFIG=str(cfg))
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"error: {said}\n"


@pytest.mark.parametrize(
    ("command", "variable"),
    [
        (["sandboxd", "settings"], "TOOLENV_SANDBOX_MAX_CONCURRENCY"),
        (["emulators", "settings"], "TOOLENV_EMULATORS_SEED"),
    ],
)
def test_the_settings_commands_say_a_bad_env_value_in_one_line(
    command: list[str], variable: str
) -> None:
    result = _invoke(command, **{variable: "abc"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert (
        result.stderr.count("\n") == 1 and "unable to parse string as an integer" in result.stderr
    )


@pytest.mark.parametrize(
    ("section", "variable"),
    [("gateway", "TOOLENV_GATEWAY_LOG_LEVEL"), ("emulators", "TOOLENV_EMULATORS_LOG_LEVEL")],
)
def test_a_log_level_is_checked_with_the_settings(section: str, variable: str) -> None:
    """An unknown level passed every check and was logging's ValueError (a traceback) at start;
    uvicorn's own names are taken in any case."""
    result = _invoke(["config", "show", "--json"], **{variable: "bogus"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == (
        f"error: invalid {section} settings: log_level: Input should be 'critical', 'error', "
        "'warning', 'info', 'debug' or 'trace'\n"
    )
    shown = _invoke(["config", "show", "--json"], **{variable: "DEBUG"})
    assert shown.exit_code == 0 and '"log_level": "debug"' in shown.stdout


def test_a_section_with_nothing_under_it_is_an_empty_section(tmp_path: Path) -> None:
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("sandbox:\ngateway:\n  port: 9000\n")
    result = _invoke(["config", "show", "--json", "--config", str(cfg)])
    assert result.exit_code == 0, (result.output, result.exception)
    assert '"port": 9000' in result.stdout
