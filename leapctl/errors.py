"""The one exception type that the CLI turns into a single readable line and exit status 2."""


class LeapctlError(Exception):
    """Bad input or an environment problem the user can fix; the message is shown as is."""
