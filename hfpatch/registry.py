"""One small registry class for every registry of hfpatch: position schemes, norms, evaluations, engines, attention
paths. A registry maps names to records, in registration order; registering a name twice is a mistake (two modules
claiming one scheme), and looking up a name it does not hold says which names it does hold.

It is a read-only `Mapping` to everything but `register`, so code that reads a registry (`name in SCHEMES`,
`SCHEMES[name]`, `SCHEMES.items()`) reads it as a dict. What is gathered from the records of a registry (the search
families of the schemes that declare one, the serving engines' readings) is a `Derived` mapping, computed at each
reading, so that a record registered later (from outside the package) is in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError, ValueError):
    """A name the registry does not hold. A KeyError for code that reads the registry as a mapping, and a
    ValueError for code that validates user input (the message lists what is available)."""

    def __str__(self) -> str:  # KeyError's own str() would quote the whole message
        return str(self.args[0])


class Registry(Mapping[str, T], Generic[T]):
    """Records by name, in registration order. `what` names the kind of record in errors ("position scheme")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._records: dict[str, T] = {}

    @classmethod
    def of(cls, what: str, records: Mapping[str, T]) -> Registry[T]:
        """A registry holding `records`, registered in their order."""
        registry: Registry[T] = cls(what)
        for name, record in records.items():
            registry.register(name, record)
        return registry

    def register(self, name: str, record: T) -> T:
        """Add `record` under `name` and return it; a name already registered raises ValueError."""
        if name in self._records:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._records[name] = record
        return record

    def __getitem__(self, name: str) -> T:
        try:
            return self._records[name]
        except KeyError:
            raise UnknownName(f"unknown {self.what} {name!r}; available: {', '.join(self._records) or 'none'}") \
                from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._records)})"


class Derived(Mapping[str, T], Generic[T]):
    """A read-only mapping computed by `build` each time it is read: what the records of registries give, with the
    records registered so far."""

    def __init__(self, build: Callable[[], Mapping[str, T]]) -> None:
        self._build = build

    def __getitem__(self, name: str) -> T:
        return self._build()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build())

    def __len__(self) -> int:
        return len(self._build())

    def __repr__(self) -> str:
        return f"Derived({dict(self._build())!r})"
