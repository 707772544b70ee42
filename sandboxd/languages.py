"""The one table of languages both backends run: source file, compile argv, run argv.

Argv lists are exec'd directly inside the sandbox's working directory (never through a shell),
with absolute interpreter and compiler paths so no PATH lookup (and no pyenv shim, which costs
about 90 ms per start) is involved. The compilers and bash hold on Debian hosts and images; the
Python interpreter comes from configuration (`find_python`, sandboxd's `python` setting).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace

DEFAULT_PYTHON = "/usr/bin/python3"

# The whole environment a sandboxed program starts with, on every backend.
CHILD_ENV: dict[str, str] = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",  # partial output survives a kill at the time limit
}


@dataclass(frozen=True, slots=True)
class Language:
    """How to build and run one program written in `name`."""

    name: str
    source_file: str  # workdir-relative name the code is written to
    run_argv: tuple[str, ...]
    compile_argv: tuple[str, ...] | None = None  # None: interpreted, no compile step
    aliases: tuple[str, ...] = ()
    artifact: str | None = None  # what the compile step produces (workdir-relative), if any
    # the program is the init of its sandbox's PID namespace (python: as a fork-server case is,
    # so that both modes behave alike; see `process.bwrap`)
    runs_as_init: bool = False

    @property
    def compiled(self) -> bool:
        return self.compile_argv is not None

    def with_python(self, python: str) -> Language:
        """This language with Python programs run by `python` (other languages unchanged)."""
        if self.name != "python":
            return self
        return replace(self, run_argv=(python, *self.run_argv[1:]))


LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language(
            name="python",
            source_file="main.py",
            run_argv=(DEFAULT_PYTHON, "main.py"),
            aliases=("python3", "py"),
            runs_as_init=True,
        ),
        Language(
            name="bash",
            source_file="main.sh",
            run_argv=("/usr/bin/bash", "main.sh"),
            aliases=("sh", "shell"),
        ),
        Language(
            name="c",
            source_file="main.c",
            compile_argv=("/usr/bin/gcc", "-O2", "-std=gnu17", "-o", "main", "main.c", "-lm"),
            run_argv=("./main",),
            artifact="main",
        ),
        Language(
            name="cpp",
            source_file="main.cpp",
            compile_argv=("/usr/bin/g++", "-O2", "-std=gnu++17", "-o", "main", "main.cpp", "-lm"),
            run_argv=("./main",),
            aliases=("c++", "cxx"),
            artifact="main",
        ),
    )
}

_BY_ALIAS: dict[str, Language] = {
    alias: lang for lang in LANGUAGES.values() for alias in (lang.name, *lang.aliases)
}


class UnknownLanguage(ValueError):
    """The requested language is not in the table; the message lists the supported ones."""

    def __init__(self, language: str) -> None:
        self.language = language
        super().__init__(
            f"unsupported language {language!r}; supported: {', '.join(supported_languages())}"
        )


def supported_languages() -> list[str]:
    return sorted(LANGUAGES)


def get_language(name: str) -> Language:
    """Look a language up by name or alias (case-insensitive); raise `UnknownLanguage` if absent."""
    lang = _BY_ALIAS.get(name.strip().lower())
    if lang is None:
        raise UnknownLanguage(name)
    return lang


class PythonNotFound(RuntimeError):
    """No interpreter for Python programs: the message says which setting names one."""


def find_python(configured: str | None) -> str:
    """The interpreter Python programs run with, as an absolute path.

    The setting wins; else /usr/bin/python3 (a distribution's, fastest to start); else `python3`
    on PATH.
    """
    candidate = configured or (
        DEFAULT_PYTHON if os.access(DEFAULT_PYTHON, os.X_OK) else shutil.which("python3")
    )
    # a directory is "executable" to os.access: every run then failed, whatever its language
    if not candidate or not os.path.isfile(candidate) or not os.access(candidate, os.X_OK):
        raise PythonNotFound(
            f"no Python interpreter for sandboxed programs ({candidate or 'python3 not on PATH'}); "
            "set TOOLENV_SANDBOX_PYTHON (sandbox.python) to one"
        )
    return os.path.abspath(candidate)
