"""The one table of languages both backends run: source file, compile argv, run argv.

Argv lists are exec'd directly inside the sandbox's working directory (never through a shell),
with absolute interpreter and compiler paths so no PATH lookup (and no pyenv shim, which costs
about 90 ms per start) is involved. The paths hold on Debian hosts and in the sandbox image,
which is built from a Debian base.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def compiled(self) -> bool:
        return self.compile_argv is not None


LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language(
            name="python",
            source_file="main.py",
            run_argv=("/usr/bin/python3", "main.py"),
            aliases=("python3", "py"),
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
