"""The exception types users see: a clear one-line message, no traceback."""


class FlashpackError(Exception):
    """An error caused by input the user can fix (a bad file, flag or request).

    The CLI prints `error: <message>` and exits non-zero; the server maps it to a 4xx.
    """


class PackDamageError(FlashpackError):
    """The pack on disk is damaged (a byte that fails its checksum, a manifest that contradicts its
    files). Not the client's fault: the server answers a request that meets it with a 5xx naming the
    damage and reports itself unhealthy; the CLI prints one line and exits 2, as for any user error."""
