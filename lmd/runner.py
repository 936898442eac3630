"""The runner below every command line: ``lmd ...`` and each ``python -m lmd.serve.X``.

A command is a plain function: its signature is the command line (through ``fire``) and its
docstring is the help, written once, beside the code. A ``Group`` names commands; a command
in a module that is slow to import (gradio, uvicorn, openai) is a ``lazy('module:function')``
reference, imported only to run it or to show its own ``--help``. A group's help reads the
docstrings of its lazy commands from their source with ``ast``, so ``lmd --help`` imports none.

Before fire runs, the arguments are checked against the function's signature: fire hands an
unknown flag to whatever the function returns (a server never returns, so the flag was
ignored), and reads a missing argument only once the function runs. Every user mistake is one
``lmd: error: ...`` line and exit status 2, never a traceback.
"""
from __future__ import annotations

import ast
import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Union

from .errors import LmdError

USAGE_ERROR = 2
INTERRUPTED = 130
HELP_FLAGS = ('-h', '--help')


class UsageError(LmdError):
    """The command line does not fit the command: an unknown flag or command, a missing argument."""


@dataclass(frozen=True)
class Lazy:
    """A command in a module imported only when the command runs: ``'package.module:function'``."""
    target: str

    def __post_init__(self):
        if not re.fullmatch(r'[\w.]+:\w+', self.target):
            raise ValueError(f"lazy({self.target!r}): expected 'package.module:function'")

    def load(self) -> Callable:
        module, _, name = self.target.partition(':')
        return getattr(importlib.import_module(module), name)

    def doc(self) -> str | None:
        """The function's docstring, read from its source without importing the module."""
        module, _, name = self.target.partition(':')
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not spec.origin.endswith('.py'):
            return inspect.getdoc(self.load())
        with open(spec.origin, encoding='utf-8') as f:
            tree = ast.parse(f.read(), spec.origin)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return ast.get_docstring(node)
        return inspect.getdoc(self.load())  # not a plain def (an alias): import it after all


def lazy(target: str) -> Lazy:
    return Lazy(target)


Command = Union[Callable, Lazy, 'Group']


@dataclass(frozen=True)
class Group:
    """Commands under one name (``lmd serve``): ``doc`` is its help, ``commands`` name -> command."""
    doc: str
    commands: dict[str, Command] = field(default_factory=dict)


# ---- checking a command line against a signature ----------------------------------------------------------

def _is_flag(arg: str) -> bool:
    """As fire reads it: '--x', '-x', '-x=1' are flags; '-1' and '-' are values."""
    return arg.startswith('--') or re.match(r'^-[a-zA-Z]', arg) is not None


def _flag(name: str) -> str:
    return '--' + name.replace('_', '-')


def _suggest(word: str, choices, prefix: str = '') -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f' (did you mean {prefix}{close[0].replace("_", "-") if prefix else close[0]}?)' if close else ''


def check_arguments(fn: Callable, args: list[str], name: str) -> None:
    """Raise UsageError where fire would ignore or misread ``args`` for ``fn``: an unknown flag, a
    positional argument too many, a required one missing. Flags follow fire: ``--name value``,
    ``--name=value``, a bare ``--name`` (True) or ``--noname`` (False) before another flag or at
    the end, ``-x`` for the one parameter starting with x; after a last ``--`` come fire's own."""
    if '--' in args:
        args = args[:len(args) - 1 - args[::-1].index('--')]
    if any(a in HELP_FLAGS for a in args):
        return  # fire shows the help
    params = list(inspect.signature(fn).parameters.values())
    takes_any_flag = any(p.kind is p.VAR_KEYWORD for p in params)
    takes_any_args = any(p.kind is p.VAR_POSITIONAL for p in params)
    params = [p for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    names = [p.name for p in params]
    named, positional, i = set(), [], 0
    while i < len(args):
        arg = args[i]
        if not _is_flag(arg):
            positional.append(arg)
            i += 1
            continue
        key, equals, _ = arg.lstrip('-').partition('=')
        key = key.replace('-', '_')
        bare = not equals and (i + 1 == len(args) or _is_flag(args[i + 1]))
        if key in names:
            keyword = key
        elif bare and key.startswith('no') and key[2:] in names:
            keyword = key[2:]
        elif len(key) == 1 and [n[0] for n in names].count(key) == 1:
            keyword = next(n for n in names if n[0] == key)
        elif len(key) == 1 and key in (n[0] for n in names):
            raise UsageError(f'{arg} is ambiguous for {name}: it could be any of '
                             + ', '.join(_flag(n) for n in names if n[0] == key))
        elif takes_any_flag:
            keyword = key
        else:
            raise UsageError(f'unknown flag {arg.partition("=")[0]} for {name}{_suggest(key, names, "--")}; '
                             f'see {name} --help')
        named.add(keyword)
        i += 1 if equals or bare else 2
    free = [p for p in params if p.name not in named and p.kind is not p.KEYWORD_ONLY]
    if len(positional) > len(free) and not takes_any_args:
        raise UsageError(f'unexpected argument {positional[len(free)]!r} for {name}; see {name} --help')
    missing = [p for p in free[len(positional):] if p.default is p.empty]
    missing += [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in named]
    if missing:
        what = ', '.join(p.name.upper() if p.kind is not p.KEYWORD_ONLY else _flag(p.name) for p in missing)
        raise UsageError(f'{name} needs {what}; see {name} --help')


# ---- walking the command tree ----------------------------------------------------------------------------

def _help_object(group: Group, name: str):
    """An object fire renders as the group's help: members with the commands' own docstrings,
    lazy ones read from source (nothing slow is imported to list them)."""
    members = {'__doc__': group.doc}
    for key, command in group.commands.items():
        if isinstance(command, Group):
            members[key] = _help_object(command, f'{name} {key}')
        else:
            def stub():
                pass
            stub.__doc__ = command.doc() if isinstance(command, Lazy) else inspect.getdoc(command)
            stub.__name__ = key
            members[key] = staticmethod(stub)
    return type(name.replace(' ', '_'), (), members)()


def _resolve(command: Command, argv: list[str], path: list[str], root: str) -> tuple[Command, list[str], list[str]]:
    """Follow subcommand names in ``argv`` down the tree: (the command or group reached, the rest of
    ``argv``, the names walked, after ``path``)."""
    while isinstance(command, Group):
        if not argv or argv[0] in HELP_FLAGS or argv[0] == '--':
            break
        word = argv[0].replace('-', '_')
        if word not in command.commands:
            what = 'flag' if _is_flag(argv[0]) else 'command'
            raise UsageError(f'unknown {what} {argv[0]!r} for {" ".join([root, *path])}'
                             f'{_suggest(word, command.commands)}; its commands: {", ".join(command.commands)}')
        command, argv, path = command.commands[word], argv[1:], [*path, word]
    return command, argv, path


def _nest(path: list[str], component):
    """``component`` as fire reaches it through ``path`` (``serve``, ``api_server``), so that its
    help and errors name the whole command, ``lmd serve api_server``."""
    for word in reversed(path):
        member = staticmethod(component) if inspect.isfunction(component) else component
        component = type(word, (), {word: member})()
    return component


# ---- running --------------------------------------------------------------------------------------------

class _CommandLineFilter(logging.Filter):
    """Passes lmd's records to the command line's handler only while nobody has set up logging
    (the servers configure the root logger; their own format then carries the lines)."""

    def filter(self, record) -> bool:
        return not logging.getLogger().handlers


def show_lmd_logs() -> None:
    """lmd's INFO lines (the engine chosen at start) and warnings on stderr as ``lmd: ...``."""
    logger = logging.getLogger('lmd')
    if any(isinstance(f, _CommandLineFilter) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter('lmd: %(message)s'))
    handler.addFilter(_CommandLineFilter())
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _show_help(fire, component, path: list[str], root: str) -> int:
    """The help of the command at ``path`` on stdout, where a user pipes it (fire writes help to
    stderr). A help flag anywhere asks for help only: fire would run the command first when it
    comes after ``--``, and for a server that never ends."""
    with contextlib.redirect_stderr(sys.stdout):
        try:
            fire.Fire(component, command=[*path, '--', '--help'], name=root)
        except fire.core.FireExit as e:
            return e.code
    return 0


def run_command(command: Command, argv: list[str] | None, name: str) -> int:
    """Run a command line (``argv`` None: ``sys.argv[1:]``) against ``command``; returns the exit
    status: the command's own when it returns an int, 2 for a user's mistake, 130 for Ctrl-C."""
    import fire
    os.environ.setdefault('PAGER', 'cat')  # fire pages --help through less on a terminal otherwise
    argv = list(sys.argv[1:] if argv is None else argv)
    root, *path = name.split()
    try:
        command, argv, path = _resolve(command, argv, path, root)
        name = ' '.join([root, *path])
        if isinstance(command, Group):
            component = _nest(path, _help_object(command, name))
            if any(a in HELP_FLAGS for a in argv):
                return _show_help(fire, component, path, root)
            fire.Fire(component, command=[*path, *argv], name=root)
            return 0
        fn = command.load() if isinstance(command, Lazy) else command
        if any(a in HELP_FLAGS for a in argv):
            return _show_help(fire, _nest(path, fn), path, root)
        check_arguments(fn, argv, name)
        show_lmd_logs()
        result = []

        @functools.wraps(fn)  # fire reads the signature and the help through __wrapped__
        def call(*args, **kwargs):
            result.append(fn(*args, **kwargs))  # kept from fire, which would print it

        fire.Fire(_nest(path, call), command=[*path, *argv], name=root)
    except fire.core.FireExit as e:
        return e.code
    except (LmdError, ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f'lmd: error: {e}', file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return INTERRUPTED
    rc = result[0] if result else None
    return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
