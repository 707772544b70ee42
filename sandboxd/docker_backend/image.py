"""The sandbox image: where its sources live, their hash, and building it when missing or stale.

`scripts/build_sandbox_image.sh` computes the same hash (sha256 of Dockerfile, agent.py, then
agent_reset.py) with `sha256sum`, so an image built by either one is accepted by the other.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import docker
import docker.errors

import sandboxd.image

IMAGE_DIR = Path(sandboxd.image.__file__).resolve().parent
SOURCE_FILES = ("Dockerfile", "agent.py", "agent_reset.py")
HASH_LABEL = "toolenv.sandbox.source-hash"

log = logging.getLogger(__name__)


class ImageBuildError(RuntimeError):
    """The sandbox image is missing and could not be built."""


def source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCE_FILES:
        digest.update((IMAGE_DIR / name).read_bytes())
    return digest.hexdigest()


def image_is_current(client: docker.DockerClient, image: str) -> bool:
    try:
        labels = client.images.get(image).labels or {}
    except docker.errors.ImageNotFound:
        return False
    return labels.get(HASH_LABEL) == source_hash()


def ensure_image(client: docker.DockerClient, image: str, base_image: str) -> bool:
    """Build `image` from sandboxd/image unless it exists with the current source hash.

    Returns True when it built. Blocking (docker SDK): call it from a worker thread.
    """
    if image_is_current(client, image):
        return False
    log.info("building sandbox image %s from %s", image, base_image)
    try:
        client.images.build(
            path=str(IMAGE_DIR),
            tag=image,
            buildargs={"BASE_IMAGE": base_image},
            labels={HASH_LABEL: source_hash()},
            rm=True,
            forcerm=True,
        )
    except (docker.errors.BuildError, docker.errors.APIError) as exc:
        raise ImageBuildError(
            f"cannot build sandbox image {image} from base {base_image}: {exc}; "
            "run scripts/build_sandbox_image.sh, or set TOOLENV_SANDBOX_DOCKER_BASE_IMAGE "
            "to an image you have"
        ) from exc
    return True
