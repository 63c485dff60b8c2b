"""Command-line flags generated from a settings dataclass's fields (ServeConfig's, for `pdserve serve`).

A field declares its flag where it is defined, `field(default=..., metadata=cli_flag("pools", "help"))`,
so a new setting gets its flag, its help and its YAML key in one place. The flag's type follows the
field's annotation (int, float, str; a bool becomes a switch; a mapping or list is given as JSON),
and every flag defaults to None: a flag that was not given must not override the YAML file.
"""

from __future__ import annotations

import argparse
import functools
import types
import typing
from collections.abc import Sequence
from dataclasses import MISSING, Field, dataclass, fields
from typing import Any, Literal

Group = Literal["pools", "auto", "router", "observability"]
# The groups of --help, in order: the key a field names in its metadata -> the title shown.
GROUP_TITLES: dict[Group, str] = {
    "pools": "pools",
    "auto": "auto mode (per-request dispatch)",
    "router": "router",
    "observability": "observability",
}


@dataclass(frozen=True)
class FlagSpec:
    """How one field is offered on the command line. `help` ends without the default: "(default X)"
    is added for a plain value; a field whose default is None, a bool or a collection says in its
    help what the default means."""

    group: Group
    help: str
    metavar: str | None = None
    choices: Sequence[str] | None = None
    negatable: bool = False  # a bool given as --x / --no-x (otherwise the switch flips its default)
    # the flag passes its text on and the settings class parses it: a value that is a number or a
    # word (--threads-per-worker N|auto), whose errors then read like any other setting's
    as_text: bool = False


def cli_flag(
    group: Group,
    help: str,
    *,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    negatable: bool = False,
    as_text: bool = False,
) -> dict[str, FlagSpec]:
    """The metadata of a field that is a flag."""
    return {"flag": FlagSpec(group, help, metavar, choices, negatable, as_text)}


def spec_of(f: Field) -> FlagSpec:
    spec = f.metadata.get("flag")
    if not isinstance(spec, FlagSpec):
        raise TypeError(f"field {f.name!r} declares no flag: field(..., metadata=cli_flag(group, help))")
    return spec


def value_type(cls: type, f: Field) -> type | None:
    """int, float, str or bool for a scalar field (None allowed); None for one given as JSON."""
    hint = _type_hints(cls)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if hint in (int, float, str, bool) else None


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # the annotations are strings (`from __future__ import annotations`)


def is_json(cls: type, f: Field) -> bool:
    return value_type(cls, f) is None


def _default(f: Field) -> Any:
    return f.default if f.default is not MISSING else None  # a default_factory's is a collection


def _help(spec: FlagSpec, default: Any) -> str:
    if default is None or isinstance(default, bool):
        return spec.help
    shown = f"{default:g}" if isinstance(default, float) else str(default)
    return f"{spec.help} (default {shown})"


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of `cls`, group by group (GROUP_TITLES order, which --help's usage line
    follows too), in field order within a group."""
    for group, title in GROUP_TITLES.items():
        g = parser.add_argument_group(title)
        for f in fields(cls):
            if spec_of(f).group == group:
                names, kwargs = _argument(cls, f)
                g.add_argument(*names, **kwargs)


def _argument(cls: type, f: Field) -> tuple[list[str], dict[str, Any]]:
    """add_argument's arguments for field `f`."""
    spec, default = spec_of(f), _default(f)
    kind = str if spec.as_text else value_type(cls, f)
    name, dest = "--" + f.name.replace("_", "-"), f.name
    common: dict[str, Any] = {"default": None, "help": _help(spec, default)}
    if kind is bool and spec.negatable:
        return [name], {"action": argparse.BooleanOptionalAction, **common}
    if kind is bool and default:  # on by default: the flag turns it off
        return ["--no-" + name[2:]], {"dest": dest, "action": "store_const", "const": False, **common}
    if kind is bool:
        return [name], {"action": "store_true", **common}
    if kind in (int, float):
        common["type"] = kind
    if spec.choices is not None:
        common["choices"] = spec.choices
    if spec.metavar is not None:
        common["metavar"] = spec.metavar
    return [name], common
