"""The exception types users see: a clear one-line message, no traceback; and the decorator every
command runs under that turns them into that line."""

from __future__ import annotations

import functools
import sys


class FlashpackError(Exception):
    """An error caused by input the user can fix (a bad file, flag or request).

    The CLI prints `error: <message>` and exits non-zero; the server maps it to a 4xx.
    """


class PackDamageError(FlashpackError):
    """The pack on disk is damaged (a byte that fails its checksum, a manifest that contradicts its
    files). Not the client's fault: the server answers a request that meets it with a 5xx naming the
    damage and reports itself unhealthy; the CLI prints one line and exits 2, as for any user error."""


def one_line_errors(command):
    """A command's user errors print `error: <message>` and exit 2; an interrupt prints one line and
    exits 130. No traceback for things the user can fix."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FlashpackError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
