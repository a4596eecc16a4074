"""The one exception type the CLI turns into a one-line `error: …` message."""


class LopdError(Exception):
    """A problem the user can fix (bad input, missing file, wrong recipe key).

    The CLI prints `error: <message>` and exits non-zero; `--debug` shows the traceback.
    """


class LopdWarning(UserWarning):
    """A setting that works but costs the user something they may not expect (the CLI prints it
    as one line `warning: …`)."""
