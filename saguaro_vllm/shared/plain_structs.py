"""The part of `msgspec` that `transport.py`'s message classes need, for a process without msgspec.

The drafter driven in-process (the GPU check, `benchmarks/device_check.py`, on a machine with torch and
nothing else) builds `StepRequest`s and gets `StepResponse`s without a socket. There `transport` falls back to
this module: `Struct` subclasses get msgspec's constructor (positional or keyword fields, class defaults,
fresh copies of mutable defaults), `frozen`, equality and repr. There is no validation, and encoding or
decoding (the socket) refuses with `MissingMsgspec`: the proposer/drafter channel needs the real msgspec.
"""
from __future__ import annotations

import copy

REASON = "msgspec is not installed: the drafter socket (transport.Channel) needs it; in-process use works"


class MissingMsgspec(ImportError):
    """Encoding or decoding a message without msgspec."""

    def __init__(self):
        super().__init__(REASON)


class ValidationError(ValueError):
    pass


class DecodeError(ValueError):
    pass


class Meta:
    """Constraint annotations (`Annotated[int, Meta(ge=0)]`): recorded, not enforced."""

    def __init__(self, **constraints):
        self.constraints = constraints


_MISSING = object()


class Struct:
    """A msgspec-like struct: fields are the class annotations in definition order (base classes first)."""

    __struct_fields__: tuple[str, ...] = ()
    __struct_defaults__: dict = {}
    __struct_frozen__ = False

    def __init_subclass__(cls, tag=None, frozen=False, forbid_unknown_fields=False, array_like=False, **kw):
        super().__init_subclass__(**kw)
        fields = list(cls.__struct_fields__)
        defaults = dict(cls.__struct_defaults__)
        for name in cls.__dict__.get("__annotations__", {}):
            if name.startswith("__") or name in fields:
                continue
            fields.append(name)
            value = cls.__dict__.get(name, _MISSING)
            if value is not _MISSING:
                defaults[name] = value
        cls.__struct_fields__ = tuple(fields)
        cls.__struct_defaults__ = defaults
        cls.__struct_frozen__ = frozen or cls.__struct_frozen__
        cls.__struct_tag__ = tag

    def __init__(self, *args, **kwargs):
        names = self.__struct_fields__
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields, got {len(args)}")
        values = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names or key in values:
                raise TypeError(f"{type(self).__name__}: unexpected or repeated field {key!r}")
            values[key] = value
        for name in names:
            if name not in values:
                if name not in self.__struct_defaults__:
                    raise TypeError(f"{type(self).__name__}: missing required field {name!r}")
                values[name] = copy.copy(self.__struct_defaults__[name])  # [] / {} defaults: one per instance
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name, value):
        if self.__struct_frozen__:
            raise AttributeError(f"immutable type: {type(self).__name__!r}")
        object.__setattr__(self, name, value)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in self.__struct_fields__)

    def __hash__(self):
        if not self.__struct_frozen__:
            raise TypeError(f"unhashable type: {type(self).__name__!r}")
        return hash(tuple(getattr(self, n) for n in self.__struct_fields__))

    def __repr__(self):
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__struct_fields__)
        return f"{type(self).__name__}({body})"


def convert(obj, typ):
    raise MissingMsgspec()


class _Encoder:
    def __init__(self, *args, **kwargs):
        pass

    def encode(self, msg):
        raise MissingMsgspec()


class _Decoder(_Encoder):
    def decode(self, data):
        raise MissingMsgspec()


class msgpack:  # noqa: N801 - stands in for the `msgspec.msgpack` module
    Encoder = _Encoder
    Decoder = _Decoder
