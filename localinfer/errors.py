"""Errors a user can cause, each carrying the exit code the CLI should end with."""

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class LocalinferError(Exception):
    """A runtime or model error: one line for the user, exit code 1."""

    exit_code = EXIT_RUNTIME


class UsageError(LocalinferError):
    """A bad argument or option value: exit code 2."""

    exit_code = EXIT_USAGE


class ModelNotFound(UsageError):
    """A model name that neither the catalogue nor the file system knows."""


class FetchError(LocalinferError):
    """No source could deliver a model file."""


class ModelLoadError(LocalinferError):
    """A file that is not a loadable model for the chosen backend."""


class DoesNotFit(LocalinferError):
    """No variant of a model fits the memory budget (the fit's refusal, naming what would)."""


class ContextOverflow(LocalinferError):
    """The prompt does not fit the context window."""
