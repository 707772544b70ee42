"""The system components `make test` installs are real and work."""

from __future__ import annotations

import subprocess


def test_docker_runs_a_container_from_the_local_base_image(
    docker_engine: str, base_image: str
) -> None:
    out = subprocess.run(
        [
            docker_engine,
            "run",
            "--rm",
            "--network",
            "none",
            base_image,
            "python3",
            "-c",
            "print(6*7)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "42"


def test_bwrap_runs_a_command_without_network(bwrap_path: str) -> None:
    code = (
        "import socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 22), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as e:\n"
        "    print('no-network', e.errno)\n"
        "print(len(socket.if_nameindex()))\n"
    )
    out = subprocess.run(
        [
            bwrap_path,
            "--unshare-all",
            "--die-with-parent",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--symlink",
            "usr/bin",
            "/bin",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "/usr/bin/python3",
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == "no-network"
    assert lines[-1] == "1"  # only the loopback interface exists in the new namespace


def test_compose_v2_is_installed(compose_v2: str) -> None:
    out = subprocess.run([compose_v2, "compose", "version"], capture_output=True, text=True)
    assert "v2." in out.stdout


def test_tiny_model_loads_with_its_chat_template(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "search the title"}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert len(ids) > 3
    assert "<|assistant|>" in tok.decode(ids)
