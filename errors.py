"""The one exception type users see: a clear one-line message, no traceback."""


class FlashpackError(Exception):
    """An error caused by input the user can fix (a bad file, flag or request).

    The CLI prints `error: <message>` and exits non-zero; the server maps it to a 4xx.
    """
