"""TOML run files for the reference trainer: `--config run.toml` under the command line.

What it is for: `parse_with_config_file(parser, argv)` reads the file named by `--config`, checks every key and value
against the parser's own options (keys are the options' dest names, `global_batch = 8`; the flag spelling
`global-batch` is accepted too, and so is a switch's own flag name: `no-progress = true` means `--no-progress`),
makes the values the parser's defaults, then parses the command line, so a flag given there wins. Relative paths
in the file are taken from the current directory, as on the command line.
What it must not do: know any option itself (it reads the parser), or accept a key or value the command line would
refuse: unknown keys and wrong types are all listed in one error (exit code 2, like any argparse error).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any


def _options_by_dest(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    options: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:  # argparse has no public list of its actions
        if action.option_strings and action.dest not in ("help", "config"):
            options.setdefault(action.dest, []).append(action)
    return options


def _switches_by_flag(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Switches whose flag spelling differs from their dest (`no_progress` for `--no-progress`, dest `progress`):
    `no_progress = true` in a file means what the flag means on the command line."""
    switches: dict[str, argparse.Action] = {}
    for action in parser._actions:
        for flag in action.option_strings:
            key = flag.lstrip("-").replace("-", "_")
            if action.nargs == 0 and flag.startswith("--") and key != action.dest:
                switches[key] = action
    return switches


def _convert(key: str, value: Any, actions: list[argparse.Action]) -> tuple[Any, str | None]:
    """(value as the option holds it, problem or None) for one TOML entry."""
    flag = actions[0].option_strings[0]
    valued = [a for a in actions if a.nargs != 0]  # options that take a value (not store_true / store_const)
    switches = [a for a in actions if a.nargs == 0]
    if isinstance(value, bool):
        for action in switches:
            if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
                return value, None
        return None, f"{key} = {str(value).lower()}: {flag} takes a value, not true/false"
    if not valued:
        names = " / ".join(a.option_strings[0] for a in switches)
        return None, f"{key} = {value!r}: {names} is a switch; write {key} = true or false"
    action = valued[0]
    kind = action.type
    if kind is int:
        if not isinstance(value, int):
            return None, f"{key} = {value!r}: {flag} takes an integer"
    elif kind is float:
        if not isinstance(value, int | float):
            return None, f"{key} = {value!r}: {flag} takes a number"
        value = float(value)  # finiteness is find_problems' rule, as for the command line
    elif not isinstance(value, str):
        return None, f"{key} = {value!r}: {flag} takes a string"
    if kind is Path:
        value = Path(value)
    if action.choices is not None and value not in action.choices:
        return None, f"{key} = {value!r}: {flag} must be one of {', '.join(map(str, action.choices))}"
    return value, None


def config_file_defaults(parser: argparse.ArgumentParser, path: str | Path) -> dict[str, Any]:
    """The options a TOML file sets, as parser defaults (dest -> value).

    Raises:
        ValueError: the file cannot be read or parsed, or holds unknown keys or wrong values (every one listed).
    """
    path = Path(path)
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"--config {path}: cannot be read as TOML ({exc})") from None
    options = _options_by_dest(parser)
    switches = _switches_by_flag(parser)
    defaults: dict[str, Any] = {}
    problems: list[str] = []
    unknown = []
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        if key == "config":
            problems.append(f"{raw_key}: a config file cannot name another config file")
        elif key in switches:
            if not isinstance(value, bool):
                problems.append(
                    f"{raw_key} = {value!r}: {switches[key].option_strings[0]} is a switch; write true or false"
                )
            elif value:  # false: as if the flag were not given
                defaults[switches[key].dest] = switches[key].const
        elif key not in options:
            unknown.append(raw_key)
        else:
            converted, problem = _convert(raw_key, value, options[key])
            if problem is None:
                defaults[key] = converted
            else:
                problems.append(problem)
    if unknown:
        known = ", ".join(sorted([*options, *switches]))
        problems.insert(0, f"unknown keys {unknown}; the keys are the option names: {known}")
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(f"--config {path}: {len(problems)} problem{'s' * (len(problems) > 1)}:\n{listed}")
    return defaults


def parse_with_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse `argv` with the values of `--config FILE` (if given) as defaults: file < command line."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is not None:
        try:
            parser.set_defaults(**config_file_defaults(parser, known.config))
        except ValueError as exc:
            parser.error(str(exc))
    return parser.parse_args(argv)


__all__ = ["config_file_defaults", "parse_with_config_file"]
