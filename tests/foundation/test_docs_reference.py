"""The docs as a reference: every link between them lands (file and heading), docs/cli.md
names every option each command's `--help` lists, in that command's section, and every dotted
name of the project's code or settings they give (`toolenv_core.timer.PreciseTimer`,
`emulators.search_profile`) exists."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel

from toolenv.cli import build_app
from toolenv.sections import SETTINGS_CLASSES

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*)$")
DOTTED = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)[`(]")  # a name, or a call
PACKAGES = {"toolenv", "toolenv_core", "sandboxd", "emulators", "gateway", "rollout_client", "stress"}  # fmt: skip


def _prose(doc: Path) -> list[str]:
    """The doc's lines outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    lines, fenced = [], False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, `-N` on
    a repeat."""
    anchors: set[str] = set()
    repeats: dict[str, int] = {}
    for line in _prose(doc):
        if match := HEADING.match(line):
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1).strip())
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            n = repeats.get(slug, 0)
            anchors.add(slug if n == 0 else f"{slug}-{n}")
            repeats[slug] = n + 1
    return anchors


def test_every_link_in_the_docs_lands() -> None:
    broken, checked = [], 0
    for doc in DOCS:
        for line in _prose(doc):
            for target in LINK.findall(line):
                if target.startswith(("http://", "https://", "mailto:")):
                    continue
                path, _, anchor = target.partition("#")
                dest = (doc.parent / path).resolve() if path else doc
                checked += 1
                if not dest.exists():
                    broken.append(f"{doc.name}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{doc.name}: {target} (no such heading in {dest.name})")
    assert checked > 30  # the pattern still finds the docs' links
    assert not broken, broken


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf command under `group` with its path (typer's click objects: duck-typed, as
    typer may carry its own copy of click)."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def _cli_sections() -> dict[str, str]:
    """docs/cli.md cut at its `## ` headings; the part before the first is the overview."""
    sections, current = {"": ""}, ""
    for line in (ROOT / "docs" / "cli.md").read_text().splitlines():
        if line.startswith("## "):
            current = line
            sections[current] = ""
        sections[current] += line + "\n"
    return sections


def test_cli_md_names_every_option_of_every_command() -> None:
    sections = _cli_sections()
    missing, checked = [], 0
    for path, command in _commands(typer.main.get_command(build_app())):
        group = "serve" if path[0] in ("serve", "gateway") else path[0]
        heading = next((h for h in sections if h and f"`toolenv {group}`" in h), "")
        text = sections[heading]
        for param in command.params:
            if param.param_type_name != "option":
                continue
            checked += 1
            if not any(re.search(re.escape(o) + r"(?![\w-])", text) for o in param.opts):
                missing.append(f"toolenv {' '.join(path)} {param.opts[0]}")
    assert checked > 100  # every command's options were found
    assert not missing, missing


def _is_setting(model: type[BaseModel], path: list[str]) -> bool:
    """`path` names a field of the settings `model`, through its nested models."""
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if i < len(path) - 1:
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                return False
            model = field.annotation
    return bool(path)


def _is_code(name: str) -> bool:
    """`name` is an importable module, or an attribute path from the longest one that imports."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_dotted_names_of_the_projects_code_and_settings_exist() -> None:
    """A user copies `from gateway.app import create_app` or sets `emulators.trace_dirs` as
    written: a module, class or setting the docs name after it moved is a dead end."""
    missing, checked = [], 0
    for doc in DOCS:
        for name in sorted(set(DOTTED.findall(doc.read_text()))):
            head, *rest = name.split(".")
            section = SETTINGS_CLASSES.get(head)
            if head not in PACKAGES and section is None:
                continue  # a file name, another library's or a field of a body
            if name.endswith((".py", ".md", ".yaml", ".json", ".jsonl", ".png", ".toml")):
                continue
            checked += 1
            if not ((section is not None and _is_setting(section, rest)) or _is_code(name)):
                missing.append(f"{doc.name}: {name}")
    assert checked > 15  # the pattern still finds the docs' names
    assert not missing, missing
