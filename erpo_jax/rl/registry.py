"""A name -> entry table that refuses a second entry of a name and, asked for
an unknown name, lists the ones it has: the loss terms, the policy losses and
the advantage estimators are each one."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """dict[str, T] in registration order; `what` names its entries in errors."""

    def __init__(self, what: str, reserved: tuple[str, ...] = ()):
        super().__init__()
        self.what, self.reserved = what, reserved

    def register(self, entry: T) -> T:
        name = entry.name
        if name in self or name in self.reserved:
            raise ValueError(f"a {self.what} named {name!r} is already registered "
                             "(or reserved).")
        self[name] = entry
        return entry

    def get_entry(self, name: str, unknown: str = "") -> T:
        """The entry `name`; ValueError `unknown` + the names otherwise."""
        try:
            return self[name]
        except KeyError:
            head = unknown or f"Unknown {self.what} {name!r}"
            raise ValueError(f"{head}; choose one of {sorted(self)}.") from None
