"""A Linux ``timerfd`` through ctypes (``os.timerfd_create`` is Python 3.13+): a clock that
an event loop waits on as it waits on a socket.

Part C's simulated engines deliver replies at drawn due times. Delivered by each loop's own
timer, a reply waits for ``epoll_wait``, whose timeout both loops round *up* to a whole
millisecond: a loop that catches up with its work sleeps up to 1 ms while replies come due
every ~30 us (at 5 ms median latency), and a loop that never catches up never pays it. A real
engine's reply is a socket becoming readable, which ends the I/O wait at once. A timerfd armed
at the next due time is readable exactly then (nanosecond resolution), so both loops see replies
as they would see sockets.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os

_CLOCK_MONOTONIC = 1  # time.monotonic() and time.perf_counter() on Linux
_TFD_NONBLOCK = os.O_NONBLOCK
_TFD_CLOEXEC = os.O_CLOEXEC
_TFD_TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_create = _libc.timerfd_create
_create.argtypes = [ctypes.c_int, ctypes.c_int]
_settime = _libc.timerfd_settime
_settime.argtypes = [
    ctypes.c_int,
    ctypes.c_int,
    ctypes.POINTER(_Itimerspec),
    ctypes.POINTER(_Itimerspec),
]


class TimerFd:
    """One absolute ``CLOCK_MONOTONIC`` timer: readable from its armed time until read or
    re-armed (re-arming clears the expirations, so a stale readiness does not linger)."""

    def __init__(self) -> None:
        fd = _create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd: int = fd
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)
        #: The armed time (``time.monotonic()`` seconds), ``inf`` when disarmed.
        self.armed = math.inf

    def arm(self, at: float) -> None:
        """Fire at ``at`` (``time.monotonic()`` seconds; ``inf`` disarms)."""
        self.armed = at
        value = self._spec.it_value
        if at == math.inf:
            value.tv_sec = value.tv_nsec = 0
        else:
            # a zero it_value disarms: a due time already past fires in 1 ns instead
            sec = int(at)
            value.tv_sec, value.tv_nsec = sec, max(1, int((at - sec) * 1e9))
        if _settime(self.fd, _TFD_TIMER_ABSTIME, self._ref, None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def clear(self) -> None:
        """Read the expirations, if any, so the fd is not readable until it fires again."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
