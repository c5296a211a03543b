"""trainer layer."""

from ._receiver import BatchReceiver as BatchReceiver
