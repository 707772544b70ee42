"""Fixtures of the stress tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from stress.testing import serve


@pytest.fixture(scope="module")
def fast_server() -> Iterator[str]:
    """A test server answering in 2-4 ms (uniform), on 127.0.0.1."""
    with serve("uniform", low_ms=2, high_ms=4, seed=3) as url:
        yield url


@pytest.fixture(scope="module")
def zero_server() -> Iterator[str]:
    """A test server answering at once, on 127.0.0.1."""
    with serve("zero") as url:
        yield url
