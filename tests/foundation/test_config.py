"""Settings objects and deadlines: the seams every service builds on."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from emulators.settings import EmulatorSettings
from gateway.settings import GatewaySettings
from sandboxd.settings import SandboxSettings
from toolenv.cli import build_app
from toolenv_core.config import ConfigFileError, config_error, read_config_file
from toolenv_core.deadline import (
    DEADLINE_HEADER,
    Deadline,
    DeadlineHeaderError,
    deadline_from_headers,
)


def test_settings_precedence_overrides_env_file(tmp_path, monkeypatch) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[gateway]\nport = 7001\nhost = '127.0.0.2'\n")
    monkeypatch.setenv("TOOLENV_GATEWAY_PORT", "7002")
    s = GatewaySettings.load(cfg)
    assert (s.host, s.port) == ("127.0.0.2", 7002)
    assert GatewaySettings.load(cfg, port=7003).port == 7003
    monkeypatch.setenv("TOOLENV_CONFIG", str(cfg))
    monkeypatch.delenv("TOOLENV_GATEWAY_PORT")
    assert GatewaySettings.load().port == 7001


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_a_float_setting_must_be_finite(value: str, monkeypatch) -> None:
    # `inf` passed `gt=0`, then `config show --json` printed `Infinity` (not JSON)
    monkeypatch.setenv("TOOLENV_GATEWAY_BODY_TIMEOUT_S", value)
    with pytest.raises(ValidationError) as caught:
        GatewaySettings()
    assert config_error(caught.value) == (
        "invalid gateway settings: body_timeout_s: Input should be a finite number"
    )
    monkeypatch.setenv("TOOLENV_SANDBOX_MAX_TIMEOUT_S", value)
    with pytest.raises(ValidationError, match="max_timeout_s"):
        SandboxSettings()
    tool = {"name": "t", "kind": "http", "upstreams": ["http://127.0.0.1:1"], "mode": "proxy"}
    with pytest.raises(ValidationError, match="finite"):  # a nested model's float too
        GatewaySettings(tools=[{**tool, "health_interval_s": value}])
    with pytest.raises(ValidationError, match="finite"):
        GatewaySettings(tools=[{**tool, "retry": {"backoff_ms": value}}])


@pytest.mark.parametrize(
    ("args", "variable", "said"),
    [
        (["config", "show"], "TOOLENV_GATEWAY_TOOLS", "TOOLS_SAID"),
        (["gateway", "serve", "--port", "1"], "TOOLENV_GATEWAY_TOOLS", "TOOLS_SAID"),
        (["rollout", "settings"], "TOOLENV_ROLLOUT_TOOL_PROFILES", "PROFILES_SAID"),
        (
            ["rollout", "run", "--synthetic", "x.json"],
            "TOOLENV_ROLLOUT_TOOL_PROFILES",
            "PROFILES_SAID",
        ),
    ],
)
def test_malformed_json_in_an_env_var_is_one_line_naming_it(
    args: list[str], variable: str, said: str
) -> None:
    """Before: `error parsing value for field "tools" from source "EnvSettingsSource"` (no
    variable, no position, no hint of what to send; `rollout settings` a traceback)."""
    env = {variable: '[{"name": "search",}]', "TOOLENV_CONFIG": None}
    result = CliRunner().invoke(build_app(), args, env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    expected = {
        "TOOLS_SAID": "TOOLENV_GATEWAY_TOOLS is not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 20, char 19); send a JSON list, e.g. "
        '[{"name": "search", "kind": "search"}, {"name": "code", "kind": "sandbox"}]',
        "PROFILES_SAID": "TOOLENV_ROLLOUT_TOOL_PROFILES is not valid JSON (Expecting property "
        "name enclosed in double quotes: line 1 column 20, char 19); send a JSON object, e.g. "
        '{"search": "search_default"}',
    }[said]
    assert result.stderr == f"error: {expected}\n"


@pytest.mark.parametrize("beside", [None, '[{"name": "search", "kind": "search"}]'])
def test_an_env_var_for_one_entry_of_a_list_is_one_line_naming_it(beside: str | None) -> None:
    """Before: `TOOLENV_GATEWAY_TOOLS__0__CONCURRENCY=5` was "invalid gateway settings: tools:
    Input should be a valid list" (no variable named), and beside TOOLENV_GATEWAY_TOOLS it was
    ignored without a word (the tool kept 64)."""
    env = {
        "TOOLENV_GATEWAY_TOOLS__0__CONCURRENCY": "5",
        "TOOLENV_GATEWAY_TOOLS": beside,
        "TOOLENV_CONFIG": None,
    }
    result = CliRunner().invoke(build_app(), ["config", "show"], env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == (
        "error: TOOLENV_GATEWAY_TOOLS__0__CONCURRENCY cannot set one entry of tools (a list): "
        "give the whole list as JSON in TOOLENV_GATEWAY_TOOLS, or in the config file\n"
    )


def test_a_config_file_that_does_not_parse_or_is_a_directory_is_one_line(tmp_path) -> None:
    # PyYAML's text spanned four lines, with a caret under `<unicode string>`
    bad = tmp_path / "c.yaml"
    bad.write_text("gateway: {port: [1,\n")
    with pytest.raises(ConfigFileError) as caught:
        read_config_file(bad)
    message = str(caught.value)
    assert "\n" not in message and "<unicode string>" not in message
    assert (
        message.startswith(f"config file {bad} does not parse as YAML: ")
        and "(line 2, column 1)" in message
    )
    with pytest.raises(ConfigFileError, match="is a directory"):  # said "does not exist"
        read_config_file(tmp_path)
    with pytest.raises(ConfigFileError, match="/dev/null is not a regular file"):  # the same
        read_config_file("/dev/null")


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("c.yaml", "sandbox:\n  max_concurrency: 3\ngateway:\n  port: 9000\nsandbox:\n  queue_size: 9\n",
         "does not parse as YAML: 'sandbox' is given twice (also on line 1): merge them into one "
         "(line 5, column 1)"),
        ("c.yaml", "sandbox:\n  max_concurrency: 3\n  max_concurrency: 5\n",
         "does not parse as YAML: 'max_concurrency' is given twice (also on line 2): merge them "
         "into one (line 3, column 3)"),
        ("c.json", '{"sandbox": {"max_concurrency": 3}, "sandbox": {"queue_size": 9}}',
         "does not parse as JSON: 'sandbox' is given twice in one object: merge them into one"),
    ],
)  # fmt: skip
def test_a_key_given_twice_in_a_config_file_is_one_line_naming_it(
    tmp_path: Path, name: str, text: str, said: str
) -> None:
    """PyYAML and json keep the last of a repeated key: a second `sandbox:` section dropped the
    first one's settings (max_concurrency 3 ran as the default) without a word."""
    cfg = tmp_path / name
    cfg.write_text(text)
    result = CliRunner().invoke(build_app(), ["sandboxd", "settings", "--config", str(cfg)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"error: config file {cfg} {said}\n"


def test_a_yaml_merge_key_may_be_overridden(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway: &g\n  port: 9000\nemulators:\n  <<: *g\n  port: 9001\n")
    assert read_config_file(cfg) == {"gateway": {"port": 9000}, "emulators": {"port": 9001}}


BOOL_SAID = "must be a number, not true (a JSON boolean is not read as 0 or 1)"


def test_a_boolean_for_a_profile_number_is_one_line_naming_the_field(tmp_path) -> None:
    """YAML's `true` was read as 1: `value_s: true` a 1-second delay on every call."""
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("emulators:\n  search_profile:\n    model: {kind: constant, value_s: true}\n")
    shown = CliRunner().invoke(build_app(), ["config", "show", "--config", str(cfg)])
    assert shown.exit_code == 2, (shown.output, shown.exception)
    assert shown.stderr == (
        f"error: invalid emulators settings: search_profile.model.constant.value_s: {BOOL_SAID}\n"
    )
    profile = tmp_path / "slow.yaml"
    profile.write_text("model:\n  kind: faulty\n  model: {kind: constant, value_s: 0.1}\n"
                       "  faults: [{type: throttle, rate: 0.1, retry_after_s: true}]\n")  # fmt: skip
    described = CliRunner().invoke(build_app(), ["emulators", "describe", str(profile)])
    assert described.exit_code == 2, (described.output, described.exception)
    assert described.stderr == (
        f"error: {profile}: field 'model.faulty.faults.0.throttle.retry_after_s': {BOOL_SAID}\n"
    )


@pytest.mark.parametrize(
    ("yaml_text", "said"),
    [
        (  # was one call at a time: the tool's whole throughput
            "gateway:\n  tools: [{name: search, kind: search, concurrency: true}]\n",
            "invalid gateway settings: tools.0.concurrency",
        ),
        (
            "gateway:\n  tools: [{name: search, kind: search, retry: {backoff_ms: true}}]\n",
            "invalid gateway settings: tools.0.retry.backoff_ms",
        ),
        ("sandbox:\n  max_timeout_s: true\n", "invalid sandbox settings: max_timeout_s"),
        ("rollout:\n  tool_timeout_s: true\n", "invalid rollout settings: tool_timeout_s"),
        ("emulators:\n  body_timeout_s: true\n", "invalid emulators settings: body_timeout_s"),
    ],
)
def test_a_boolean_for_a_number_setting_is_one_line_naming_it(
    tmp_path, yaml_text: str, said: str
) -> None:
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(yaml_text)
    shown = CliRunner().invoke(build_app(), ["config", "show", "--config", str(cfg)])
    assert shown.exit_code == 2, (shown.output, shown.exception)
    assert shown.stderr == f"error: {said}: {BOOL_SAID}\n"


def test_deadline_header_round_trip_and_bounds() -> None:
    d = deadline_from_headers({DEADLINE_HEADER: "1500"}, default_s=10, max_s=60)
    assert 1.3 < d.remaining() <= 1.5
    clamped = deadline_from_headers({DEADLINE_HEADER: "999999"}, default_s=10, max_s=2)
    assert clamped.remaining() <= 2
    assert deadline_from_headers({}, default_s=None, max_s=None).remaining() == float("inf")
    with pytest.raises(DeadlineHeaderError, match="milliseconds"):
        deadline_from_headers({DEADLINE_HEADER: "soon"}, default_s=1, max_s=2)
    with pytest.raises(DeadlineHeaderError):
        deadline_from_headers({DEADLINE_HEADER: "-5"}, default_s=1, max_s=2)
    # Python's float() reads "1_000": no other client's parser would, so neither does this one
    with pytest.raises(DeadlineHeaderError, match="number of milliseconds, got '1_000'"):
        deadline_from_headers({DEADLINE_HEADER: "1_000"}, default_s=1, max_s=2)
    # a long value is quoted in part, not echoed whole into the 400
    with pytest.raises(DeadlineHeaderError, match=r"got 'xxxxxxxxxxxxxxxxxxxx'\.\.\. \(5000 ch"):
        deadline_from_headers({DEADLINE_HEADER: "x" * 5000}, default_s=1, max_s=2)
    short = Deadline.after(0.05)
    assert int(short.to_header_value()) <= 50
    time.sleep(0.06)
    assert short.expired and short.remaining() == 0


def test_serve_reads_the_config_file_once_and_builds_each_service_from_its_section(
    tmp_path, monkeypatch
) -> None:
    from emulators.settings import EmulatorSettings
    from toolenv.wiring import build_mounts
    from toolenv_core.config import read_sections

    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "gateway:\n  port: 7011\n  tools: [{name: search, kind: search}]\n"
        "emulators:\n  seed: 42\n  default_deadline_s: 3\n"
    )
    monkeypatch.setenv("TOOLENV_CONFIG", str(cfg))
    sections = read_sections()
    cfg.unlink()  # read once: nothing after this may need the file
    settings = GatewaySettings.from_sections(sections)
    assert settings.port == 7011 and [t.name for t in settings.tools] == ["search"]
    emulators = EmulatorSettings.from_sections(sections)
    assert emulators.seed == 42 and emulators.deadline_policy.default_s == 3
    mounts = build_mounts(settings, sections)
    assert set(mounts) == {"emulators"}  # only what an embedded tool of the table needs
    assert mounts["emulators"].state.settings.seed == 42


def test_a_config_file_that_is_not_text_or_cannot_be_read_is_one_line_naming_it(
    tmp_path, monkeypatch
) -> None:
    # said "'utf-8' codec can't decode byte 0xff in position 0" without naming the file
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"\xff\xfegateway: {}\n")
    with pytest.raises(ConfigFileError) as caught:
        read_config_file(binary)
    assert str(caught.value) == (
        f"config file {binary} is not UTF-8 text (byte 0xff at offset 0): "
        "name a YAML, TOML or JSON file"
    )

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "read_text", denied)  # root reads a chmod 000 file anyway
    with pytest.raises(ConfigFileError) as caught:
        read_config_file(binary)
    assert str(caught.value) == f"config file {binary} cannot be read: Permission denied"


def test_a_config_file_suffix_in_capitals_names_its_format(tmp_path) -> None:
    """`toolenv.TOML` was read as YAML: "expected '<document start>', but found '<scalar>'"."""
    upper = tmp_path / "toolenv.TOML"
    upper.write_text("[gateway]\nport = 9000\n")
    assert read_config_file(upper) == {"gateway": {"port": 9000}}
    other = tmp_path / "toolenv.conf"  # any other suffix is YAML, and the error says so
    other.write_text("[gateway]\nport = 9000\n")
    with pytest.raises(ConfigFileError, match=r"toolenv.conf does not parse as YAML: "):
        read_config_file(other)


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yaml"])
def test_a_config_file_that_starts_with_a_byte_order_mark_is_read(tmp_path, suffix: str) -> None:
    """An editor's UTF-8 BOM: TOML said "Invalid statement (at line 1, column 1)", JSON
    "Unexpected UTF-8 BOM (decode using utf-8-sig)", of a file that reads right in the editor."""
    text = {
        ".toml": "[gateway]\nport = 9000\n",
        ".json": '{"gateway": {"port": 9000}}',
        ".yaml": "gateway:\n  port: 9000\n",
    }[suffix]
    path = tmp_path / f"toolenv{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert read_config_file(path) == {"gateway": {"port": 9000}}


@pytest.mark.parametrize(
    ("group", "variable", "value", "said"),
    [
        # a negative seed passed the settings, then `emulators serve` said only "error: expected
        # non-negative integer" (numpy's words, no setting named)
        ("emulators", "TOOLENV_EMULATORS_SEED", "-1", "invalid emulators settings: seed: "),
        ("sandboxd", "TOOLENV_SANDBOX_MAX_CONCURRENCY", "-3", "invalid sandbox settings: "),
    ],
)
def test_a_settings_command_names_the_section_and_field(
    group: str, variable: str, value: str, said: str
) -> None:
    env = {variable: value, "TOOLENV_CONFIG": None}
    result = CliRunner().invoke(build_app(), [group, "settings"], env=env)
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {said}"), result.stderr


def test_an_empty_variable_is_no_setting_in_every_section(monkeypatch) -> None:
    """`TOOLENV_EMULATORS_SEARCH_PROFILE_FILE=` (compose's `${VAR}` with VAR unset) was Path("") =
    ".": `emulators serve` said `error: .: cannot read: Is a directory`; an empty
    `TOOLENV_SANDBOX_PYTHON` was the interpreter "". Empty means the default, as for traces."""
    monkeypatch.delenv("TOOLENV_CONFIG", raising=False)
    monkeypatch.setenv("TOOLENV_EMULATORS_SEARCH_PROFILE_FILE", "")
    monkeypatch.setenv("TOOLENV_EMULATORS_PORT", "")
    monkeypatch.setenv("TOOLENV_SANDBOX_PYTHON", "")
    emulators = EmulatorSettings.load()
    assert emulators.search_profile_file is None and emulators.port == 8090
    assert SandboxSettings.load().python is None


@pytest.mark.parametrize(
    ("group", "section", "key", "value"),
    [
        ("emulators", "emulators", "port", 9101),
        ("sandboxd", "sandbox", "port", 9102),
        ("rollout", "rollout", "batch", 7),
    ],
)
def test_a_settings_command_reads_the_config_file_it_is_given(
    tmp_path: Path, group: str, section: str, key: str, value: int
) -> None:
    """`toolenv emulators serve --config FILE` reads FILE, but `toolenv emulators settings
    --config FILE` was `No such option: --config`: it could not show what serve would use."""
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(f"{section}:\n  {key}: {value}\n")
    result = CliRunner().invoke(
        build_app(), [group, "settings", "--config", str(cfg)], env={"TOOLENV_CONFIG": None}
    )
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads(result.stdout)[key] == value
