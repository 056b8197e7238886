"""The ``statekeeper`` command group: global options, output, and the one error translation.

Every command prints its result either for people (rich tables) or, with ``--json``, as one
JSON document on stdout. Errors never print a traceback unless ``--verbose`` is given: they
print one line on stderr naming what failed, and exit with

* ``0`` when all is well,
* ``1`` when problems were found or the operation failed (corrupt or missing blobs, storage
  errors),
* ``2`` on a usage error: a malformed option, or a root, operator, partition or version that
  does not exist.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

import click
from rich.console import Console
from rich.logging import RichHandler

from statekeeper.errors import StateKeeperError

__all__ = [
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "CliError",
    "Env",
    "UsageFailure",
    "cli",
    "env_of",
    "output_options",
]

EXIT_PROBLEMS = 1
EXIT_USAGE = 2
_META_KEY = "statekeeper.env"
_F = TypeVar("_F", bound=Callable[..., Any])


class CliError(click.ClickException):
    """A failure reported as one line on stderr; exit code 1."""

    exit_code = EXIT_PROBLEMS

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))

    def show(self, file: IO[Any] | None = None) -> None:
        """Print ``statekeeper: error: <message>`` as a single line on stderr."""
        click.echo(f"statekeeper: error: {self.format_message()}", file=file, err=file is None)


class UsageFailure(CliError):
    """A usage error (exit code 2): something named on the command line does not exist."""

    exit_code = EXIT_USAGE


def one_line(message: str) -> str:
    """``message`` with every run of whitespace (newlines included) made one space."""
    return " ".join(message.split())


@dataclass
class Env:
    """Options shared by every command, whether given before or after the command name."""

    json: bool = False
    verbose: bool = False
    _console: Console | None = field(default=None, repr=False)
    _handler: logging.Handler | None = field(default=None, repr=False)

    @property
    def console(self) -> Console:
        """The rich console on stdout (created on first use, inside the invocation)."""
        if self._console is None:
            self._console = Console(highlight=False)
        return self._console

    @property
    def progress_enabled(self) -> bool:
        """Progress bars are shown only to a person: stdout is a terminal and not ``--json``."""
        return not self.json and self.console.is_terminal

    def emit_json(self, document: object) -> None:
        """Print ``document`` on stdout exactly as ``json.dumps(document, indent=2)`` would,
        writing as it goes: a list given as an iterator is written a chunk of items at a
        time and never held whole (``inspect``/``diff --limit 0`` of millions of keys), and
        a value given as a function is computed when its turn comes (a flag that the items
        before it decide). Iterators and functions count as such among the values of the
        document (a dict) and of the dicts a streamed list yields; deeper, they are not
        looked for."""
        writer = _JsonWriter()
        writer.write(document, "")
        writer.flush("\n")

    def enable_verbose(self, ctx: click.Context) -> None:
        """Send statekeeper's INFO logs to stderr until the invocation ends."""
        self.verbose = True
        if self._handler is not None:
            return
        handler = RichHandler(console=Console(stderr=True), show_path=False, markup=False)
        logger = logging.getLogger("statekeeper")
        previous = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        self._handler = handler

        def remove() -> None:
            logger.removeHandler(handler)
            logger.setLevel(previous)
            self._handler = None

        ctx.find_root().call_on_close(remove)


def env_of(ctx: click.Context) -> Env:
    """The :class:`Env` of this invocation (shared by the group and the command)."""
    env = ctx.meta.get(_META_KEY)
    if not isinstance(env, Env):
        env = ctx.meta[_META_KEY] = Env()
    return env


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        env_of(ctx).json = True


def _set_verbose(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        env_of(ctx).enable_verbose(ctx)


def output_options(f: _F) -> _F:
    """Add ``--json`` and ``--verbose`` to a command (they are also accepted on the group)."""
    f = click.option(
        "--json",
        "json_output",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        help="Print one JSON document on stdout instead of tables.",
    )(f)
    return click.option(
        "--verbose",
        "-v",
        is_flag=True,
        expose_value=False,
        callback=_set_verbose,
        help="Log what the library does, and print tracebacks of errors.",
    )(f)


class _Group(click.Group):
    """A group whose every error, usage errors included, is one line on stderr."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as exc:
            raise _usage(exc) from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort, click.exceptions.NoArgsIsHelpError):
            raise
        except CliError as exc:
            _trace(ctx, exc)
            raise
        except click.UsageError as exc:
            _trace(ctx, exc)
            raise _usage(exc) from exc
        except click.ClickException as exc:
            _trace(ctx, exc)
            raise CliError(exc.format_message()) from exc
        except StateKeeperError as exc:
            _trace(ctx, exc)
            raise CliError(str(exc)) from exc
        except OSError as exc:
            _trace(ctx, exc)
            raise CliError(str(exc)) from exc
        except Exception as exc:  # the last resort of a command line: one line, not a trace
            _trace(ctx, exc)
            hint = "" if env_of(ctx).verbose else " (run with --verbose for the traceback)"
            raise CliError(f"unexpected {type(exc).__name__}: {exc}{hint}") from exc


def _usage(exc: click.UsageError) -> UsageFailure:
    where = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
    return UsageFailure(exc.format_message() + where)


def _trace(ctx: click.Context, exc: BaseException) -> None:
    if env_of(ctx).verbose:
        click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)


@click.group(
    "statekeeper",
    cls=_Group,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@output_options
@click.version_option(package_name="statekeeper", prog_name="statekeeper")
def cli() -> None:
    """See, check, restore and clean a statekeeper checkpoint root.

    ROOT is a local path or a URI (file://, s3://, gs://, az://). Object store settings
    come from --storage-option KEY=VALUE (repeatable) or obstore's environment variables
    (AWS_*, GOOGLE_*, AZURE_*).

    Exit codes: 0 ok, 1 problems found or the operation failed, 2 usage error.
    """


class _JsonWriter:
    """The pieces of an indented JSON document, written to stdout every
    :data:`_FLUSH_ITEMS` items of a streamed list (a write per item would double the time)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []

    def flush(self, end: str = "") -> None:
        click.echo("".join(self._pieces) + end, nl=False)
        self._pieces.clear()

    def write(self, value: object, pad: str) -> None:
        if callable(value):
            value = value()
        if not _lazy(value):  # all there: one encoder call
            text = _ENCODER.encode(value)
            self._pieces.append(text.replace("\n", "\n" + pad) if pad else text)
        elif isinstance(value, dict):
            self._dict(value, pad)
        elif isinstance(value, Iterator | list | tuple):
            self._list(iter(value), pad)
        else:
            raise TypeError(f"cannot write a {type(value).__name__} as JSON")

    def _dict(self, value: dict[Any, Any], pad: str) -> None:
        inner = pad + "  "
        for i, (key, item) in enumerate(value.items()):
            name = key if isinstance(key, str) else json.dumps(key)
            self._pieces.append(("{" if i == 0 else ",") + f"\n{inner}{json.dumps(name)}: ")
            self.write(item, inner)
        self._pieces.append(f"\n{pad}}}")

    def _list(self, items: Iterator[object], pad: str) -> None:
        inner = pad + "  "
        count = 0
        for item in items:
            self._pieces.append(("[" if count == 0 else ",") + f"\n{inner}")
            self.write(item, inner)
            count += 1
            if count % _FLUSH_ITEMS == 0:
                self.flush()
        self._pieces.append(f"\n{pad}]" if count else "[]")


_FLUSH_ITEMS = 1000


def _lazy(value: object) -> bool:
    """Whether ``value`` is written piece by piece: an iterator or a function, or a dict,
    list or tuple that holds one directly. Only that deep (a document's values, or those of
    a dict a streamed list yields), so that an item's own values, however large or deeply
    nested, cost no walk and reach ``json`` whole."""
    kind = type(value)
    if kind is dict:
        return any(map(_deferred, value.values()))  # type: ignore[attr-defined]
    if kind is list or kind is tuple:
        return any(map(_deferred, value))  # type: ignore[call-overload]
    return _deferred(value)


def _deferred(value: object) -> bool:
    kind = type(value)
    if value is None or kind in _PLAIN:  # the common case, without an ABC check
        return False
    return callable(value) or isinstance(value, Iterator)


_PLAIN = frozenset({str, int, float, bool, bytes, dict, list, tuple})
_ENCODER = json.JSONEncoder(indent=2, default=str)
