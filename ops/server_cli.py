"""Command line and config file -> ServerArgs: the argparse parser built from
ops/server_args.py's OPTIONS table, the YAML config file, and their merge.

Theory of operation: argparse records only the options the user typed (every default
is SUPPRESS), so the merge can rank the sources: ServerArgs defaults < --config file <
command line. msgspec converts the merged mapping, and a type error is reported with
the flag as the user spells it and where its value came from.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from shunter.ops.server_args import (
    CHOICES,
    DTYPE_ALIASES,
    FIELDS,
    FLAG_OF,
    GROUPS,
    OPTIONS,
    REFUSED,
    ServerArgs,
)

# ---- argparse -----------------------------------------------------------------------


def _field_type(field: str) -> tuple[type, bool]:
    """(scalar type, is_flag) of a ServerArgs field, from its annotation."""
    default = ServerArgs.__struct_defaults__[ServerArgs.__struct_fields__.index(field)]
    if isinstance(default, bool):
        return bool, True
    annotation = str(ServerArgs.__annotations__[field]).removeprefix("list[")
    for name, t in (("int", int), ("float", float), ("str", str)):
        if annotation.startswith(name):
            return t, False
    raise AssertionError(f"no scalar type for {field}: {annotation}")


def _default_text(field: str) -> str:
    default = ServerArgs.__struct_defaults__[ServerArgs.__struct_fields__.index(field)]
    return "" if default is None or isinstance(default, bool) else f" (default: {default})"


_METAVARS = {
    "model_path": "PATH", "tokenizer_path": "PATH", "chat_template": "TEMPLATE",
    "record_events": "DIR", "bus_dir": "DIR", "host": "HOST", "api_key": "KEY", "admin_api_key": "KEY",
    "served_model_name": "NAME", "mem_fraction_static": "FRACTION",
    "hicache_storage_max_size": "GB",
}  # fmt: skip


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every option, grouped for --help. Defaults are SUPPRESSed so that the parsed
    namespace holds only what the user typed (the config file fills the rest)."""
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    groups["deployment"].add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS,
        help="YAML file of options (long names as keys, - or _); the command line overrides it",
    )  # fmt: skip
    for field, flags, group, help_ in OPTIONS:
        kind, is_flag = _field_type(field)
        kw: dict[str, Any] = {"dest": field, "default": argparse.SUPPRESS}
        if is_flag:
            kw.update(action="store_true", help=help_)
        else:
            kw.update(type=kind, help=help_ + _default_text(field))
            if str(ServerArgs.__annotations__[field]).startswith("list["):
                kw["nargs"] = "+"
            if field in CHOICES:
                kw["choices"] = CHOICES[field] + (tuple(DTYPE_ALIASES) if field == "dtype" else ())
            else:
                kw["metavar"] = (
                    _METAVARS.get(field) or {int: "N", float: "SECONDS", str: "STR"}[kind]
                )
        groups[group].add_argument(*flags, **kw)
    refused = parser.add_argument_group("not supported yet")
    for flags, why in REFUSED.items():
        refused.add_argument(*flags, nargs="*", metavar="ARG", action=_Refused,
                             default=argparse.SUPPRESS, help=why, why=why)  # fmt: skip


class _Refused(argparse.Action):
    """An option this server does not support: using it is an error that says why."""

    def __init__(self, *args: Any, why: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: {self.why}")


def build_parser(prog: str = "shunter serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    add_server_arguments(parser)
    return parser


# ---- config file and merging --------------------------------------------------------


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML (or JSON) options file into {field: value}. Keys are long option
    names with - or _ ("max-prefill-tokens", "max_prefill_tokens", aliases too)."""
    import yaml

    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--config: {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"--config: {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(f"--config: {path} must hold a mapping of option: value")
    alias_to_field = {
        flag[2:].replace("-", "_"): field for field, flags, _, _ in OPTIONS for flag in flags
    }
    refused = {flag[2:].replace("-", "_"): why for flags, why in REFUSED.items() for flag in flags}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        field = alias_to_field.get(name)
        why = refused.get(name)
        if why is not None:
            raise ValueError(f"--config: {path}: {key!r}: {why}")
        if field is None:
            raise ValueError(f"--config: {path}: unknown option {key!r}")
        if field in out:
            raise ValueError(f"--config: {path}: {key!r} repeats {FLAG_OF[field]}")
        out[field] = value
    return out


def server_args_from(cli: Mapping[str, Any], config_file: str | None = None) -> ServerArgs:
    """Merge ServerArgs defaults < config file < command line, then validate."""
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    if config_file is not None:
        merged.update(load_config_file(config_file))
        source.update(dict.fromkeys(merged, f"--config {config_file}"))
    for key, value in cli.items():
        if key in FIELDS:
            merged[key] = value
            source[key] = "command line"
    if isinstance(merged.get("dtype"), str):  # "half", "bf16", ...: the name stored
        merged["dtype"] = DTYPE_ALIASES.get(merged["dtype"], merged["dtype"])
    try:
        return msgspec.convert(merged, ServerArgs, strict=False)
    except msgspec.ValidationError as e:
        # msgspec names the offending field as `$.field`; say which flag and source.
        text = str(e)
        for field in merged:
            if f"`$.{field}`" in text:
                raise ValueError(
                    f"{FLAG_OF[field]} {merged[field]!r} (from {source[field]}): "
                    f"{text.split(' - at ')[0]}"
                ) from None
        raise ValueError(text) from None


def parse_server_args(argv: Sequence[str]) -> ServerArgs:
    """argv -> validated ServerArgs (config file included). Raises ValueError; argparse
    itself exits with status 2 on unknown options or malformed values."""
    ns = build_parser().parse_args(list(argv))
    return server_args_from(vars(ns), getattr(ns, "config", None))


def namespace_to_server_args(ns: argparse.Namespace) -> ServerArgs:
    return server_args_from(vars(ns), getattr(ns, "config", None))
