"""The one exception type the CLI turns into a one-line `error: …` message."""


class LopdError(Exception):
    """A problem the user can fix (bad input, missing file, wrong recipe key).

    The CLI prints `error: <message>` and exits non-zero; `--debug` shows the traceback.
    """
