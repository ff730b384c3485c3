"""The one exception type that the CLI turns into a single readable line and exit status 2."""


class LeapctlError(Exception):
    """Bad input or an environment problem the user can fix; the message is shown as is."""


def one_line(exc: BaseException) -> str:
    """An exception's message cut to its first non-empty line (its type name when it has none): libraries'
    messages run to several lines, and an error must stay one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__
