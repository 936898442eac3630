"""Errors lmd raises for bad input; the CLI prints them as one line, the servers as 4xx."""


class LmdError(Exception):
    """Base of lmd's user-facing errors."""


class ModelNotFoundError(LmdError, FileNotFoundError):
    """The model name or path resolves to nothing that exists here."""


class ModelFormatError(LmdError, ValueError):
    """A model file or directory exists but cannot be read as a model."""
