"""An in-process app's lifespan failing: said as the exception the app raised, not Starlette's
traceback text of it (which went as is into /readyz, every 503 and the log)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette

from gateway.asgi import Lifespan, LifespanError


class StorageGone(Exception):
    pass


def _app(fail_at: str, error: Exception) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        if fail_at == "startup":
            raise error
        yield
        raise error

    return Starlette(lifespan=lifespan)


async def test_a_start_up_failure_is_the_exception_raised() -> None:
    lifespan = Lifespan(_app("startup", StorageGone("the volume is not mounted")), "app")
    with pytest.raises(LifespanError) as err:
        await lifespan.start()
    assert str(err.value) == "app failed to start: StorageGone: the volume is not mounted"


async def test_a_shut_down_failure_is_the_exception_raised() -> None:
    lifespan = Lifespan(_app("shutdown", RuntimeError("flush failed\nsecond line")), "app")
    await lifespan.start()
    with pytest.raises(LifespanError) as err:
        await lifespan.stop()
    assert str(err.value) == "app failed to shut down: RuntimeError: flush failed\nsecond line"


async def test_an_exception_without_text_is_named_by_its_class() -> None:
    lifespan = Lifespan(_app("startup", StorageGone()), "app")
    with pytest.raises(LifespanError) as err:
        await lifespan.start()
    assert str(err.value) == "app failed to start: StorageGone"
