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


class Interrupted(ServesimError):
    """Ctrl-C / SIGTERM: the message says what was kept (CLI exit code 130)."""

    exit_code = 130


def one_line(text: object, limit: int = 200) -> str:
    """``text`` as one line of at most ``limit`` characters (for echoing user input back)."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def printable(text: object) -> str:
    """``text`` with control characters and line separators escaped (``\\x1e``, ``\\n``, ...),
    so a message that echoes user input stays one line on a terminal and in ``splitlines``."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() or c == " " else
                   c.encode("unicode_escape").decode("ascii") for c in s)


def _path_test(test) -> bool:
    """``test()`` (a bound ``Path.is_file`` / ``is_dir`` of a user-given name): False, not an
    OSError, for a name the OS cannot even look up (too long, an embedded NUL byte)."""
    try:
        return test()
    except (OSError, ValueError):
        return False


def path_is_file(path) -> bool:
    """``path.is_file()``, False where the name cannot be looked up (:func:`_path_test`)."""
    return _path_test(path.is_file)


def path_is_dir(path) -> bool:
    """``path.is_dir()``, False where the name cannot be looked up (:func:`_path_test`)."""
    return _path_test(path.is_dir)


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, without building the repr of a huge
    container (a 200,000-element list or a YAML alias bomb is described, not printed)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)) and len(value) > 20:
        return f"<{type(value).__name__} of {len(value):,} items>"
    try:
        r = reprlib_repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails must not hide the real error
        r = f"<{type(value).__name__}>"
    return one_line(r, limit)


def reprlib_repr(value: object) -> str:
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = 60
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 6
    r.maxlevel = 3
    return r.repr(value)


class in_file:  # used as a context manager: ``with in_file(path): ...``
    """Prefix a :class:`ServesimError` raised inside with ``"<path>: "`` unless its message
    already names the file (errors raised after a config was loaded name key and file)."""

    def __init__(self, path: object):
        self.path = str(path)

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if (exc is not None and isinstance(exc, ServesimError)
                and not isinstance(exc, Interrupted) and self.path
                and not str(exc).startswith(self.path)):
            exc.args = (f"{self.path}: {exc}",) + exc.args[1:]
        return False


# ---------------------------------------------------------------------------------------------
# Warnings on the command line: one ``warning: ...`` line per distinct message per run, also
# from worker processes (sweeps, plans), which inherit SERVESIM_WARNINGS from the CLI.

WARNINGS_ENV = "SERVESIM_WARNINGS"  # "off", or the path of the run's seen-messages file


def install_cli_warnings(quiet: bool) -> str | None:
    """Set up CLI warnings for this process and its children; returns the file to remove at
    exit (None under ``quiet``, where warnings are dropped)."""
    import os
    import tempfile

    if quiet:
        os.environ[WARNINGS_ENV] = "off"
        _install("off")
        return None
    fd, path = tempfile.mkstemp(prefix="servesim-warned-", suffix=".txt")
    os.close(fd)
    os.environ[WARNINGS_ENV] = path
    _install(path)
    return path


def _install(spec: str) -> None:
    import hashlib
    import sys
    import warnings

    if spec == "off":
        warnings.simplefilter("ignore")
        return
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = one_line(message, 2000)
        key = hashlib.sha1(f"{category.__name__}:{text}".encode()).hexdigest()[:16]
        if key in seen:
            return
        seen.add(key)
        try:  # once per run across processes: the first to record the key prints it
            import fcntl

            with open(spec, "a+", encoding="utf-8") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.seek(0)
                if key in f.read().split():
                    return
                f.write(key + "\n")
        except (OSError, ImportError):
            pass
        (file or sys.stderr).write(f"warning: {text}\n")

    warnings.showwarning = show


def _install_from_env() -> None:
    import os

    spec = os.environ.get(WARNINGS_ENV)
    if spec:
        _install(spec)


_install_from_env()
