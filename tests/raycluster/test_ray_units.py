"""The Ray wiring without a cluster: config to deployment options, the gateway replicas' socket,
the CLI's checks, and no Ray needed outside `--ray`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from ray.exceptions import RayTaskError
from typer.testing import CliRunner

import toolenv.ray.app as ray_app
from rollout_client import study_ray
from toolenv.cli import build_app
from toolenv.ray.app import REPLICA_ENV, RayStack, build_application, replica_options
from toolenv.ray.ingress import listen_socket
from toolenv.ray_settings import RaySettings, ReplicaConfig
from toolenv_core.net import free_port
from toolenv_core.sigterm import Terminated


def test_fixed_replicas_and_autoscaling_bounds_become_serve_options() -> None:
    fixed = ReplicaConfig(num_cpus=2, max_ongoing_requests=8, min_replicas=3, max_replicas=3)
    opts = fixed.deployment_options()
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2}
    assert opts["max_ongoing_requests"] == 8

    auto = ReplicaConfig(
        min_replicas=1, max_replicas=5, target_ongoing_requests=4, resources={"sandbox_node": 1}
    ).deployment_options()
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["min_replicas"] == 1
    assert auto["autoscaling_config"]["max_replicas"] == 5
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 4
    assert auto["ray_actor_options"]["resources"] == {"sandbox_node": 1}


def test_inverted_bounds_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="min_replicas exceeds max_replicas"):
        ReplicaConfig(min_replicas=4, max_replicas=2)


def test_a_look_back_window_within_the_report_interval_is_a_clear_error(tmp_path: Path) -> None:
    """docs/ray.md advises longer `metrics_interval_s` at scale; with the default 2 s look-back
    window, Serve took 5 s with a FutureWarning ("will raise an exception in a future release")
    in the deploying command's output. Refused as a config error; a longer window deploys
    without a warning, and a fixed replica count (no autoscaling) reads neither."""
    with pytest.raises(ValueError, match=r"look_back_period_s \(2\.0\) must exceed metrics"):
        ReplicaConfig(min_replicas=1, max_replicas=4, metrics_interval_s=5)
    ReplicaConfig(min_replicas=2, max_replicas=2, metrics_interval_s=5)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "ray:\n  sandbox: {min_replicas: 1, max_replicas: 4, metrics_interval_s: 5,"
        " look_back_period_s: 10}\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        build_application(RayStack.load(str(cfg)))


def test_ray_section_loads_from_a_config_file(tmp_path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("ray:\n  address: 10.0.0.1:6379\n  sandbox: {num_cpus: 4, max_replicas: 9}\n")
    settings = RaySettings.load(str(cfg))
    assert settings.address == "10.0.0.1:6379"
    assert settings.sandbox.num_cpus == 4 and settings.sandbox.max_replicas == 9


def test_gateway_and_cli_need_no_ray() -> None:
    """Ray is an optional extra: everything but `--ray` works without it."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import gateway.app, toolenv.cli\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(toolenv.cli.build_app(), ['serve', '--ray', 'auto', '--detach'])\n"
        "print(r.exit_code, r.output)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 ") and "pip install 'toolenv[ray]'" in done.stdout


def test_replicas_run_on_their_own_loop_without_access_logs() -> None:
    opts = replica_options(ReplicaConfig(num_cpus=0.5), 40.0)
    assert opts["graceful_shutdown_timeout_s"] == 40.0
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": REPLICA_ENV}
    assert REPLICA_ENV["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert REPLICA_ENV["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert int(REPLICA_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) == 2**31 - 1
    assert REPLICA_ENV["GRPC_EXPERIMENTS"] == "-event_engine_client,-event_engine_listener"
    assert opts["logging_config"] == {"enable_access_log": False, "log_level": "WARNING"}


def test_gateway_replicas_share_their_port() -> None:
    """A replacement gateway replica binds beside the one it replaces (SO_REUSEPORT)."""
    first = listen_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    first.listen()
    second = listen_socket("127.0.0.1", port)
    second.listen()
    assert second.getsockname()[1] == port
    first.close()
    second.close()


def test_detach_with_a_local_cluster_is_refused() -> None:
    """A local cluster ends with the command that started it: nothing would stay deployed."""
    result = CliRunner().invoke(build_app(), ["serve", "--ray", "local", "--detach"])
    assert result.exit_code == 2
    # one `error:` line, as every other refused option (it was a bare, red-only line)
    assert result.output.startswith("error: --detach needs a running cluster"), result.output


def _toolenv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it; a connect that hangs (Ray retries for minutes) fails the test."""
    return subprocess.run([sys.executable, "-m", "toolenv", *args], capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip


@pytest.mark.parametrize(
    ("address", "env", "said"),
    [
        ("127.0.0.1:{port}", {}, "no Ray cluster answers at 127.0.0.1:{port}"),
        ("auto", {"RAY_ADDRESS": "127.0.0.1:{port}"}, "no Ray cluster answers at auto"),
        ("not an address", {}, "no Ray cluster at 'not an address': not HOST:PORT"),
        (":", {}, "no Ray cluster at ':': not HOST:PORT"),
        ("127.0.0.1:99999", {}, "no Ray cluster at '127.0.0.1:99999': not HOST:PORT"),
    ],
    ids=["closed-port", "auto-to-a-closed-port", "not-an-address", "no-host", "no-such-port"],
)
def test_an_address_with_no_cluster_is_a_one_line_error_at_once(
    address: str, env: dict[str, str], said: str
) -> None:
    """Not Ray's 20 connection attempts of about 40 s each, nor a traceback."""
    port = str(free_port())  # closed: nothing listens there
    environ = {**os.environ, **{k: v.format(port=port) for k, v in env.items()}}
    started = time.monotonic()
    done = _toolenv("serve", "--ray", address.format(port=port), env=environ)
    assert done.returncode == 1, done.stderr[-2000:]
    assert time.monotonic() - started < 30
    assert said.format(port=port) in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_study_on_an_unreachable_cluster_fails_before_loading_anything(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    done = _toolenv("rollout", "study", "--trace", str(tmp_path / "none.jsonl"), "--no-plots",
                    "--out", str(tmp_path / "out"), "--ray", address)  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"no Ray cluster answers at {address}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out").exists()


def test_options_ray_refuses_are_a_config_error_before_any_cluster_starts(tmp_path: Path) -> None:
    """Ray's own checks of a deployment's options (a negative resource) are a one-line config
    error, not a traceback after a local cluster was started for nothing."""
    config = tmp_path / "c.yaml"
    config.write_text("ray:\n  sandbox: {resources: {sandbox_node: -1}}\n")
    done = _toolenv("serve", "--ray", "local", "-c", str(config))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "sandbox_node cannot be negative" in done.stderr and "Traceback" not in done.stderr
    assert "Started a local Ray instance" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["rollout", "study", "--ray", "--trace", "search_r1", "--quick"],
        ["serve", "--ray", "--detach"],
        ["serve", "--ray", " "],
    ],
    ids=["study-then-an-option", "serve-then-an-option", "blank"],
)
def test_ray_without_an_address_says_so_and_takes_no_option_as_one(argv: list[str]) -> None:
    """`--ray` needs its ADDRESS (`local` for a new cluster): the option after it is not taken
    as a cluster to dial (which then left that option missing), and nothing starts."""
    result = CliRunner().invoke(build_app(), argv)
    said = " ".join(result.output.replace("│", " ").split())  # rich's error box, unwrapped
    assert result.exit_code == 2, said
    assert "needs an ADDRESS (`local` for a new cluster on this machine" in said, said
    assert "Missing option" not in said and "Started a local Ray" not in said


def test_mode_with_ray_is_refused_not_ignored() -> None:
    """`--mode` places a local gateway's tools; on Ray it was ignored without a word."""
    result = CliRunner().invoke(build_app(), ["serve", "--ray", "local", "--mode", "proxy"])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, said
    assert "Invalid value for --mode: places the tools of a gateway on this machine" in said
    assert "Started a local Ray" not in said


def test_a_cell_that_raised_on_ray_raises_its_own_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's error on a Ray worker comes back wrapped in Ray's `RayTaskError`, whose message
    starts `ray::_cell() (pid=..., ip=...)`: that was the study's one line (`error: ray::_cell()
    (pid=25598, ip=10.77.180.1)`). The cell's own error is raised, as in a local run."""
    cause = ValueError("cost profile 'calib.json' is neither a built-in nor a file")
    wrapped = RayTaskError("_cell", "Traceback ...", cause, pid=25598, ip="10.77.180.1")

    def get(_ref: object) -> None:
        raise wrapped.as_instanceof_cause()

    monkeypatch.setattr(study_ray.ray, "get", get)
    with pytest.raises(ValueError) as raised:
        study_ray.cell_row(None)  # type: ignore[arg-type]
    assert str(raised.value).splitlines()[0] == str(cause)


def test_replicas_no_node_can_take_are_named_with_what_they_need(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a replica needs against what each live node has: `--ray local` refuses such a
    config at once (its cluster gets no other node), and a start that timed out says it even
    before Serve does (after 30 s; the line read `sandbox: DeploymentStatus.UPDATING`)."""
    nodes = [
        {"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9, "node_head": 1.0}},
        {"Alive": False, "Resources": {"CPU": 64.0, "gpu_node": 1.0}},  # dead: takes nothing
    ]
    monkeypatch.setattr(ray_app.ray, "nodes", lambda: nodes)
    assert ray_app.no_node_takes(RaySettings()) is None
    settings = RaySettings.model_validate(
        {"sandbox": {"num_cpus": 64}, "emulators": {"num_cpus": 0, "resources": {"gpu_node": 1}}}
    )
    said = ray_app.no_node_takes(settings)
    assert said == (
        "sandbox (a replica needs {'CPU': 64.0}; the nodes have [{'CPU': 2.0}]); "
        "emulators (a replica needs {'CPU': 0.0, 'gpu_node': 1.0}; the nodes have "
        "[{'CPU': 2.0, 'gpu_node': 0.0}])"
    )


def test_a_stop_signal_raised_inside_rays_wait_comes_out_as_itself() -> None:
    """SIGTERM's `Terminated` raised by its handler inside Ray's C wait came out as a
    `SystemError` ("returned a result with an exception set"): exit 1 and a traceback, where the
    study ends by SIGTERM. Other errors pass unchanged."""
    with pytest.raises(Terminated), study_ray.stop_signals_unwrapped():
        try:
            raise Terminated
        except Terminated as signalled:
            raise SystemError(
                "CoreWorker.wait returned a result with an exception set"
            ) from signalled
    with pytest.raises(SystemError), study_ray.stop_signals_unwrapped():
        raise SystemError("not a signal") from ValueError("x")
