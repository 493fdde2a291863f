"""Errors the command line reports as one line, without a traceback."""


class UsageError(Exception):
    """Bad input from the user: a missing model, a dataset too small, a foreign state directory..."""


class CorruptStateError(UsageError):
    """A state file does not match its recorded checksum or cannot be parsed."""


class StaleEpochError(Exception):
    """A newer epoch of workers has begun: this worker must not commit anything and should exit."""
