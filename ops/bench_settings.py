"""`--set NAME=VALUE` for the device benchmark: a module constant of the package
changed in this process before the engine is built, so that a variant (a kernel's
tiles, a fusion switched on, a dispatch threshold) is measured by the same bench as
the default, one process each, and the summary records what was changed.

NAME is a module path under the package and an UPPER_CASE constant of it
(`kernels.linear.SKINNY_MAX_ROWS`); VALUE is a Python literal of the constant's type
(an int where a float is, too). Anything else is a ValueError naming the setting.
"""

from __future__ import annotations

import ast
import importlib
import sys
from typing import Any

PACKAGE = "shunter"


def parse(text: str) -> tuple[str, str, Any]:
    """(module, constant, value) of one NAME=VALUE."""
    name, eq, raw = text.partition("=")
    module, _, const = name.strip().rpartition(".")
    if not eq or not module or not const.isupper():
        raise ValueError(f"--set {text!r}: expected module.path.CONSTANT=VALUE")
    try:
        value = ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"--set {text!r}: {raw.strip()!r} is not a Python literal") from None
    return module, const, value


def apply(texts: list[str]) -> dict[str, Any]:
    """Set every NAME=VALUE (all checked before any is set); {NAME: value} as set."""
    changes = []
    for text in texts:
        module, const, value = parse(text)
        try:
            mod = importlib.import_module(f"{PACKAGE}.{module}")
        except ModuleNotFoundError:
            raise ValueError(f"--set {text!r}: no module {PACKAGE}.{module}") from None
        if not hasattr(mod, const):
            raise ValueError(f"--set {text!r}: {PACKAGE}.{module} has no {const}")
        old = getattr(mod, const)
        same = isinstance(value, type(old)) or (type(old) is float and type(value) is int)
        if not same or (type(old) is int and type(value) is bool):
            raise ValueError(f"--set {text!r}: {const} is of type {type(old).__name__}, "
                             f"got {type(value).__name__}")  # fmt: skip
        changes.append((mod, f"{module}.{const}", const, value))
    for mod, _, const, value in changes:
        setattr(mod, const, value)
    return {name: value for _, name, _, value in changes}


def apply_or_report(texts: list[str] | None, prog: str) -> dict[str, Any] | None:
    """`apply(texts)`, or None once the error is on stderr as `prog: ...` (a bench's
    exit status 2)."""
    try:
        return apply(texts or [])
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
