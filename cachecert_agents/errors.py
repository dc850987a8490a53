"""Exceptions raised by cachecert-agents. Every one carries a message that says what to do next."""

from __future__ import annotations


class CacheCertError(Exception):
    """Base class of every error raised on purpose by this library."""


class UnknownModelError(CacheCertError, KeyError):
    """A model name is neither an embedded model, a local directory nor a loadable Hugging Face id."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelNotInstalledError(CacheCertError):
    """An embedded model is known but its weights are not in the user cache directory."""


class ModelInstallError(CacheCertError):
    """Fetching, assembling or verifying an embedded model failed."""


class GeometryMismatchError(CacheCertError, ValueError):
    """A cache segment, statistic or artifact belongs to a model of another geometry."""


class CertificateError(CacheCertError, ValueError):
    """A certificate is missing, corrupt, or does not belong to the pair, mapper or score it is used with."""
