"""Command-line errors of ``lightning-dml``: one useful line first, with the options a typo could have meant.

Every parser of the CLI refuses abbreviated options (``allow_abbrev=False``: argparse would silently take
``--trainer.max_epoch`` for ``--trainer.max_epochs``), and its errors go through :func:`explain`, which turns
argparse's and jsonargparse's messages about an unknown option or config key into one line naming the closest
valid ones (:func:`difflib.get_close_matches`; an abbreviation names every option it is a prefix of). No usage
block is printed: ``<command> --help`` lists the options.

Standard library only: the CLI's errors and ``--help`` must not wait for torch to import.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

_OPTION = re.compile(r"(?<![\w.\-])--[A-Za-z_][\w.\-]*")


def option_names(help_text: str) -> list[str]:
    """The long options (``--name``) a parser's ``format_help()`` lists, in order, each once."""
    return list(dict.fromkeys(match.rstrip(".") for match in _OPTION.findall(help_text)))


def suggest(given: str, candidates: Iterable[str]) -> str:
    """``" (did you mean A or B?)"``: the candidates ``given`` abbreviates, else the closest by spelling (empty
    when none is close)."""
    names = [c for c in dict.fromkeys(candidates) if c != given]
    longer = sorted((c for c in names if c.startswith(given)), key=len)  # the shortest first
    if longer:
        return f" (abbreviations are not accepted; did you mean {' or '.join(longer[:4])}?)"
    close = difflib.get_close_matches(given, names, n=3, cutoff=0.7)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def class_init_keys(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s constructor takes (its own and, through ``**kwargs``, its bases');
    empty when the class cannot be imported."""
    import importlib

    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return []
    keys: list[str] = []
    for klass in getattr(cls, "__mro__", [cls]):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        keys += [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return list(dict.fromkeys(keys))


def explain(message: str, options: Iterable[str]) -> str:
    """One line for a parser's error ``message``; ``options`` are the parser's long options (``--name``).

    * ``unrecognized arguments: --x 3`` (argparse, jsonargparse): ``unknown option --x`` + :func:`suggest`;
    * ``Subcommand 'fit' does not accept option 'model.x'`` (a config file's key): ``unknown key 'model.x'``;
    * ``Problem with given class_path 'C': Option 'x' is not accepted`` under ``Parser key "data"`` (an
      ``init_args`` key): ``unknown key 'data.init_args.x' (C takes ...)`` with the constructor's arguments;
    * anything else is kept as it is.
    """
    options = list(options)
    unknown = re.match(r"unrecognized arguments: (.*)", message, re.S)
    if unknown:
        given = [word.split("=", 1)[0] for word in unknown.group(1).split() if word.startswith("-")]
        if not given:
            return f"unexpected argument(s): {unknown.group(1).strip()}"
        return "; ".join(f"unknown option {word}{suggest(word, options)}" for word in given)
    refused = re.search(r"does not accept options? '([^']+)'", message)
    if refused:
        key = refused.group(1)
        return f"unknown key '{key}'{suggest(key, [o[2:] for o in options])}"
    nested = re.search(r"class_path '([^']+)':\s*Option '([^']+)' is not accepted", message)
    if nested:
        class_path, key = nested.groups()
        where = re.search(r'Parser key "([^"]+)"', message)
        prefix = f"{where.group(1)}.init_args." if where else ""
        keys = class_init_keys(class_path)
        hint = suggest(key, keys)
        if not hint and keys:
            hint = f" ({class_path.rpartition('.')[2]} takes: {', '.join(keys)})"
        return f"unknown key '{prefix}{key}' for {class_path}{hint}"
    return message.strip()


def instantiation_reason(error: BaseException) -> str:
    """The reason in a constructor's error that jsonargparse re-raised while instantiating a configuration's
    classes: for a class given where a union of types is accepted (``loss: nn.Module | str``) the message lists
    each type's error (``- ProxyAnchorLoss: alpha must be > 0, got -1.0``, ``- Expected a <class 'str'>``); the
    constructor's lines are kept, the union's type mismatches dropped, all on one line."""
    message = str(error)
    listed = [line.strip()[2:].strip() for line in message.splitlines() if line.strip().startswith("- ")]
    reasons = [line for line in listed if not line.startswith("Expected a ")]
    if reasons:
        return "; ".join(reasons)
    return " ".join(message.split())


def exit_with_error(prog: str, message: str, options: Iterable[str]) -> NoReturn:
    """Print ``<prog>: error: <one line>`` and where the options are listed on stderr, exit with status 2 (as
    argparse does), no usage block."""
    sys.stderr.write(f"{prog}: error: {explain(message, options)}\n`{prog} --help` lists the options\n")
    raise SystemExit(2)


class CommandParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` that refuses abbreviated options and reports errors through :func:`explain`
    (one line, the closest options named). Its subcommand parsers are of the same class."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self.subcommand_parsers: dict[str, argparse.ArgumentParser] = {}

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self.subcommand_parsers = action.choices  # name -> parser (argparse's documented Action.choices)
        return action

    def all_option_names(self) -> list[str]:
        """The long options of this parser and of its subcommands' parsers."""
        names = option_names(self.format_help())
        for parser in self.subcommand_parsers.values():
            if isinstance(parser, CommandParser):
                names += parser.all_option_names()
            else:
                names += option_names(parser.format_help())
        return list(dict.fromkeys(names))

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """argparse's, and an error for a left-over option that abbreviates one of this parser's: a command that
        hands its unknown arguments on (``cv``, ``sweep`` and ``report`` give them to ``fit``/``predict``) must not
        hand on ``--num_fold`` for ``--num_folds``."""
        self.given_args = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        own = self.all_option_names()
        for word in extras:
            name = word.split("=", 1)[0]
            if name.startswith("--") and name not in own and any(option.startswith(name) for option in own):
                self.error(f"unrecognized arguments: {word}")
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        """One line (:func:`explain`); an unknown option is named first, before the required options it left
        missing (argparse reports only these: ``--ind x`` for ``--index x``)."""
        options = self.all_option_names()
        unknown = [
            word for word in getattr(self, "given_args", [])
            if word.startswith("--") and word.split("=", 1)[0] not in options
        ]
        if unknown and "unrecognized arguments" not in message:
            message = f"unrecognized arguments: {' '.join(unknown)}"
        exit_with_error(self.prog, message, options)


__all__ = ["CommandParser", "class_init_keys", "exit_with_error", "explain", "option_names", "suggest"]
