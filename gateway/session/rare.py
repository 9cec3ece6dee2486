"""`RareField`: an attribute most instances keep at its default, stored out of line.

A broker holds one `Session` and one `MQTTConnection` per device, most of them idle, and most of
their fields never leave their defaults (an expiry timer, drop counts, a limit's refusal, a
`hold` count...). An owner declares such fields as `RareField(default)`: they read and write as
plain attributes, live in one object of the owner's `_RARE_CLASS` held in its `_rare` slot, made
at the first value other than a default and dropped when every field is back at its default. An
idle device pays one slot for all of them (docs/gateway.md "Idle connections").
"""
from __future__ import annotations

from typing import Any


class RareField:
    __slots__ = ("name", "default", "fields")

    def __init__(self, default: Any) -> None:
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        fields = owner.__dict__.get("_RARE_FIELDS")
        if fields is None:
            fields = []
            setattr(owner, "_RARE_FIELDS", fields)
        fields.append(self)
        self.fields = fields

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        r = obj._rare
        return self.default if r is None else getattr(r, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        # the default again (an int or bool equal to it: a hold count back to 0): nothing to keep.
        # A mutable default (an empty-dict sentinel) only by identity: a new empty dict is kept
        d = self.default
        back = value is d or (d.__class__ in (int, bool) and value.__class__ is d.__class__ and value == d)
        r = obj._rare
        if r is None:
            if back:
                return
            r = obj._rare = obj._RARE_CLASS()
        setattr(r, self.name, value)
        if back and all(getattr(r, f.name) is f.default for f in self.fields):
            obj._rare = None        # every field at its default again


def rare_defaults(rare: Any, fields: list[RareField]) -> None:
    """Set each of `fields` to its default on a new rare-state object."""
    for f in fields:
        setattr(rare, f.name, f.default)
