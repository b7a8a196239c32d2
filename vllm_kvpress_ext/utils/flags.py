"""`env_flag`: how every on/off environment switch of the package is read, in one place."""

from __future__ import annotations

import os

_OFF = ("", "0", "false", "no")


def env_flag(name: str) -> bool:
    """Whether environment variable `name` is set to anything but empty, 0, false or no (any case).

    Read at each call, not cached: the switches may be flipped at run time (the test suite does).
    """
    return os.environ.get(name, "").strip().lower() not in _OFF
