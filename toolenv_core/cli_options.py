"""Options that more than one command spells, spelled once.

- `--config/-c FILE`: every command that reads the settings (serve, the `settings` commands,
  `config show`, `rollout run`).
- `--ray ADDRESS` (`toolenv serve`, `toolenv rollout study`): the address is required, since
  `--ray` with no value would take the next option as its address (`--ray --trace X` read
  `--trace` as a cluster, then said `--trace` was missing). Ray itself is not imported here: the
  option parses without the optional extra installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigFileOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Config file (YAML/TOML/JSON); default $TOOLENV_CONFIG."),
]

RAY_ADDRESS_HELP = (
    "ADDRESS: a running cluster (`auto`, HOST:PORT, ray://HOST:PORT), or `local` to start one on "
    "this machine."
)


def ray_address(value: str | None) -> str | None:
    """Typer callback: an address, never an option that followed `--ray` without one."""
    if value is not None and (not value.strip() or value.startswith("-")):
        given = f"the option {value!r}" if value.startswith("-") else "an empty address"
        raise typer.BadParameter(
            f"needs an ADDRESS (`local` for a new cluster on this machine, `auto`, HOST:PORT), "
            f"got {given}"
        )
    return value
