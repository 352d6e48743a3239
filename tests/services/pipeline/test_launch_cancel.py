"""A cancel before the run starts is recognised however the code it interrupted wrapped it."""

from __future__ import annotations

import signal

from pydantic_settings import SettingsError

from services.pipeline import launch


def raised(error: BaseException, cause: BaseException) -> BaseException:
    try:
        raise error from cause
    except BaseException as caught:
        return caught


def test_a_stop_wrapped_by_a_library_is_still_a_cancel() -> None:
    stop = launch._StoppedBeforeStart()
    wrapped = raised(SettingsError('error getting value for field "ray_address"'), stop)
    assert launch._stopped_before_start(stop)
    assert launch._stopped_before_start(wrapped)
    assert launch._stopped_before_start(SystemExit(signal.SIGTERM))


def test_other_errors_are_not_a_cancel() -> None:
    assert not launch._stopped_before_start(SettingsError("a bad RAY_ADDRESS"))
    assert not launch._stopped_before_start(SystemExit(1))
    assert not launch._stopped_before_start(raised(RuntimeError("x"), ValueError("y")))
