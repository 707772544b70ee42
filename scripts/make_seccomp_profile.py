"""Write compose/seccomp-bwrap.json: Docker's default seccomp profile plus what bubblewrap needs.

Docker's default profile allows clone/unshare with namespace flags, mount, umount2, pivot_root
and sethostname only to containers holding CAP_SYS_ADMIN. bubblewrap, creating a user namespace
without that capability, needs exactly those six calls (each found by removing it and watching
bwrap fail: "unshare user ns", "pivot_root", "unmount old root", "Can't set hostname"). Nothing
else is added; the kernel's own capability checks still apply to every call.

The input is the engine's default profile as Docker ships it
(profiles/seccomp/default.json of moby; on Debian, in the package
golang-github-docker-docker-dev: `apt-get download golang-github-docker-docker-dev`).

    python scripts/make_seccomp_profile.py /usr/share/gocode/src/github.com/docker/docker/profiles/seccomp/default.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BWRAP_CALLS = ["clone", "unshare", "mount", "umount2", "pivot_root", "sethostname"]
OUT = Path(__file__).resolve().parents[1] / "compose" / "seccomp-bwrap.json"


def main(default_profile: str) -> None:
    profile = json.loads(Path(default_profile).read_text())
    profile["syscalls"].append(
        {
            "names": BWRAP_CALLS,
            "action": "SCMP_ACT_ALLOW",
            "args": [],
            "comment": "toolenv: bubblewrap builds its sandbox in a new user namespace "
            "(no CAP_SYS_ADMIN in the container); see scripts/make_seccomp_profile.py",
            "includes": {},
            "excludes": {},
        }
    )
    OUT.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {OUT} ({len(profile['syscalls'])} rules)")


if __name__ == "__main__":
    main(sys.argv[1])
