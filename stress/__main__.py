"""`python -m stress ...`: the same command as `toolenv stress`."""

from .cli import build_app

build_app()(prog_name="toolenv stress")
