"""What the harness hands Hypothesis: the default settings of its ready-made tests, and the
example database namespaced by the subject under test."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from hypothesis import Phase, settings
from hypothesis.database import ExampleDatabase

from ._subject import RolloutSubject

#: Every phase but "explain", which re-runs failing examples under a tracer (slow, and the
#: schedule in the error already explains).
PHASES = tuple(p for p in Phase if p is not Phase.explain)


class SubjectDatabase(ExampleDatabase):
    """Another Hypothesis example database, with every key prefixed by a namespace."""

    def __init__(self, inner: ExampleDatabase, namespace: bytes) -> None:
        super().__init__()
        self.inner = inner
        self.prefix = hashlib.sha256(namespace).digest()

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.prefix + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.prefix + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.prefix + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.prefix + src, self.prefix + dest, value)


def subject_digest(subject: RolloutSubject) -> bytes:
    """The subject's components by name: what tells two subjects' saved examples apart."""

    def name(value: object) -> str:
        return (
            str(getattr(value, "__module__", ""))
            + "."
            + str(getattr(value, "__qualname__", type(value).__qualname__))
        )

    parts = [name(p) for p in subject.policies]
    parts += [name(subject.runner), name(subject.generate), name(subject.scheduler)]
    parts += [name(subject.rule), repr(subject.kinds), str(subject.max_steps)]
    return "|".join(parts).encode()


def namespaced(chosen: settings, namespace: bytes) -> settings:
    """``chosen`` with its example database (if any) namespaced: failing examples saved in
    Hypothesis's database are keyed by the test function, the same for every subject, so
    properties and machines of different subjects would replay each other's examples."""
    if chosen.database is None:
        return chosen
    return settings(chosen, database=SubjectDatabase(chosen.database, namespace))
