"""The manifest of the published PolyTrace files, shipped inside the package (`upstream.json`).

Each entry names a file by its local name (the layout of the trace cache, e.g.
`search_r1/multiturn_workload_step_0.jsonl`), its path in the upstream repository at a pinned
commit, its size and its sha256. `toolenv traces fetch` downloads and verifies against it; the data
itself is never shipped (the upstream repository carries no licence).
"""

from __future__ import annotations

import fnmatch
import json
from importlib.resources import files

from pydantic import BaseModel, Field


class ManifestEntry(BaseModel):
    name: str = Field(description="local name: the path under the trace cache")
    upstream: str = Field(description="path in the upstream repository at the pinned commit")
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Manifest(BaseModel):
    repository: str
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    base_url: str = Field(description="raw files at the pinned commit: base_url + upstream path")
    files: list[ManifestEntry]

    def select(self, patterns: list[str] | None = None) -> list[ManifestEntry]:
        """Entries whose local name matches a pattern: a glob, a directory (`search_r1`) or a
        file name; all entries when no pattern is given. A pattern matching nothing is an error."""
        if not patterns:
            return list(self.files)
        chosen: dict[str, ManifestEntry] = {}
        for pattern in patterns:
            p = pattern.strip("/")
            hits = [
                e
                for e in self.files
                if fnmatch.fnmatchcase(e.name, p)
                or e.name.startswith(p + "/")
                or e.name.rsplit("/", 1)[-1] == p
            ]
            if not hits:
                dirs = sorted({e.name.split("/", 1)[0] for e in self.files})
                raise ValueError(
                    f"{pattern!r} matches no published PolyTrace file "
                    f"(directories: {', '.join(dirs)}; globs like 'search_r1/*step_0*' work)"
                )
            chosen.update((e.name, e) for e in hits)
        return [e for e in self.files if e.name in chosen]


def load_manifest() -> Manifest:
    """The manifest shipped with this package."""
    text = files(__package__).joinpath("upstream.json").read_text(encoding="utf-8")
    return Manifest.model_validate(json.loads(text))
