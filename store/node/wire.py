"""Typed JSON messages for the node protocol (protocol.py): a frozen dataclass becomes a message
type with `to_wire()` (its JSON object) and `from_wire(obj)` (every field checked against its
declared type, `BadRequest` naming the first wrong one), by `message_type` over the field codecs below.

Why a module of its own: protocol.py says what the `gw_*` commands are (names, fields, replies,
the version rule); how any dataclass goes to JSON and back - base64 bytes, optional, nested,
list, tuple and dict fields - is a codec that says nothing about any command. Pure Python,
imports nothing of lmqtt (tests/architecture/test_layering.py: a unit of its own).
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import types
import typing
from typing import Any, Callable, ClassVar


class BadRequest(ValueError):
    """A request (or reply) that does not match its type: names the command and the field."""


# ---------------------------------------------------------------- field codecs
# A codec is (decode(wire value, path) -> value, encode(value) -> wire value); decode raises
# _Wrong(what it expected, at which path) and `from_wire` turns that into BadRequest.
class _Wrong(Exception):
    def __init__(self, path: str, want: str, got: Any) -> None:
        super().__init__(path)
        self.path, self.want, self.got = path, want, got


def _show(v: Any) -> str:
    kind = {str: "a string", int: "an integer", bool: "a boolean", float: "a number", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)
    text = json.dumps(v) if isinstance(v, (str, int, float, bool)) else ""
    return f"{kind} ({text[:40]})" if text else kind


def _same(v):
    return v


def _scalar(t: type, want: str):
    def dec(v, path):
        if type(v) is not t:
            raise _Wrong(path, want, v)
        return v
    return dec, _same


def _bytes_codec():
    def dec(v, path):
        if type(v) is not str:
            raise _Wrong(path, "a base64 string", v)
        try:
            return base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            raise _Wrong(path, "a base64 string", v) from None
    return dec, lambda b: base64.b64encode(b).decode()


def _codec(tp) -> tuple[Callable, Callable]:
    """The codec of a field annotated `tp` (the types this module's messages use)."""
    if tp is str:
        return _scalar(str, "a string")
    if tp is bool:
        return _scalar(bool, "a boolean")
    if tp is int:
        return _scalar(int, "an integer")
    if tp is bytes:
        return _bytes_codec()
    if tp is dict or tp is Any:                  # an opaque JSON object (a replay cursor)
        return _scalar(dict, "an object")
    if dataclasses.is_dataclass(tp):
        def dec_dc(v, path, tp=tp):
            if type(v) is not dict:
                raise _Wrong(path, "an object", v)
            return tp._decode(v, path + ".")
        return dec_dc, lambda x: x.to_wire()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"unsupported field type {tp!r}")
        d, e = _codec(inner[0])
        return (lambda v, path: None if v is None else d(v, path)), (lambda x: None if x is None else e(x))
    if origin is list:
        (item,) = args
        if item is str:                          # the common case, checked in one pass
            def dec_strs(v, path):
                if type(v) is not list:
                    raise _Wrong(path, "a list of strings", v)
                if not all(type(x) is str for x in v):
                    i = next(i for i, x in enumerate(v) if type(x) is not str)
                    raise _Wrong(f"{path}[{i}]", "a string", v[i])
                return v
            return dec_strs, _same
        d, e = _codec(item)

        def dec_list(v, path):
            if type(v) is not list:
                raise _Wrong(path, "a list", v)
            return [d(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return dec_list, (lambda xs: [e(x) for x in xs])
    if origin is tuple:
        parts = [_codec(a) for a in args]

        def dec_tuple(v, path):
            if type(v) is not list or len(v) != len(parts):
                raise _Wrong(path, f"a list of {len(parts)}", v)
            return tuple(d(x, f"{path}[{i}]") for i, ((d, _e), x) in enumerate(zip(parts, v)))
        return dec_tuple, (lambda xs: [e(x) for (_d, e), x in zip(parts, xs)])
    if origin is dict:
        key, val = args
        if key is not str:
            raise TypeError(f"unsupported field type {tp!r}")
        d, e = _codec(val)

        def dec_dict(v, path):
            if type(v) is not dict:
                raise _Wrong(path, "an object", v)
            return {k: d(x, f"{path}.{k}") for k, x in v.items()}
        return dec_dict, (lambda m: {k: e(x) for k, x in m.items()})
    raise TypeError(f"unsupported field type {tp!r}")


# field metadata: left out of to_wire when equal to its default (what the node has always done
# for these reply fields); not on the wire at all (a MESSAGES reply's entries)
OMIT_DEFAULT = {"omit_default": True}
NOT_WIRE = {"wire": False}
_MISSING = dataclasses.MISSING


class Wire:
    """What every message type has: `to_wire()` (the JSON object) and `from_wire(obj)` (checked);
    built by `message_type` from the dataclass fields."""

    __slots__ = ()
    _fields: ClassVar[tuple] = ()        # (name, decode, encode, default, default_factory, omit_default)
    _label: ClassVar[str] = ""           # "gw_pull" / "gw_pull reply": errors name it
    has_messages: ClassVar[bool] = False

    def to_wire(self) -> dict:
        out = {}
        for name, _dec, enc, default, _factory, omit in self._fields:
            v = getattr(self, name)
            if omit and v == default:
                continue
            out[name] = enc(v)
        return out

    @classmethod
    def from_wire(cls, obj: dict, messages: list | None = None):
        """`obj` checked against the fields (BadRequest names the first bad one); `messages`:
        a MESSAGES reply's entries."""
        if type(obj) is not dict:
            raise BadRequest(f"{cls._label}: the body must be a JSON object, got {_show(obj)}")
        try:
            kw = cls._decode(obj, "")
        except _Wrong as w:
            if w.got is _MISSING:
                raise BadRequest(f"{cls._label}: field {w.path!r} is missing") from None
            raise BadRequest(f"{cls._label}: field {w.path!r} must be {w.want}, got {_show(w.got)}") from None
        if cls.has_messages:
            kw["messages"] = messages if messages is not None else []
        return cls(**kw)

    @classmethod
    def _decode(cls, obj: dict, prefix: str):
        kw = {}
        for name, dec, _enc, default, factory, _omit in cls._fields:
            v = obj.get(name, _MISSING)
            if v is _MISSING:
                if default is _MISSING and factory is _MISSING:
                    raise _Wrong(prefix + name, "", _MISSING)
                continue
            kw[name] = dec(v, prefix + name)
        if prefix:                       # a nested value (HolderInfo): the object itself
            return cls(**kw)
        return kw


def message_type(cls, label: str):
    """`cls` made a frozen, slotted dataclass with the codecs of its fields; `label` names it in
    BadRequest."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if not f.metadata.get("wire", True):
            cls.has_messages = True
            continue
        dec, enc = _codec(hints[f.name])
        fields.append((f.name, dec, enc, f.default, f.default_factory, bool(f.metadata.get("omit_default"))))
    cls._fields = tuple(fields)
    cls._label = label
    return cls
