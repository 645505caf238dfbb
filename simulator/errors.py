"""User-facing errors.

Every error a user can cause (bad YAML, unknown key, impossible config, malformed trace row)
is raised as a :class:`ServesimError` whose message is one line naming the place (file, key
path or line) and what was expected. The CLI prints it and exits with code 2; ``--debug``
shows the traceback.
"""


class ServesimError(Exception):
    """A one-line, user-facing error (CLI exit code 2)."""

    exit_code = 2


class ConfigError(ServesimError):
    """Invalid or inconsistent configuration."""


class CapacityError(ServesimError):
    """The configuration cannot run: the model does not fit, or max_model_len exceeds the KV cache."""


class TraceError(ServesimError):
    """A trace file that cannot be read (malformed row, empty file, ...)."""
