"""Refused credentials: the one failure a node or a client must not wait out.

Owns: :class:`CredentialsError`, what the board, every queue backend and the
retry loop raise when a server refused who we are (a wrong or missing
password, a user without a permission), so callers can tell it from an outage
(which they wait for). Must never: import a client library (each side
classifies its own library's errors and raises this).
"""

from __future__ import annotations


class CredentialsError(RuntimeError):
    """A server refused this process's credentials or permissions: waiting will not cure it, the
    message says which server and what to check."""


def authentication_failed(where: str, error: BaseException | str, check: str) -> CredentialsError:
    """The error for a refused login at ``where`` (no secret in it), saying what to ``check``."""
    return CredentialsError(f"authentication failed for {where} ({_reason(error)}): check {check}")


def permission_denied(where: str, error: BaseException | str, check: str) -> CredentialsError:
    """The error for a user ``where`` lets in but does not let do something, saying what to ``check``."""
    return CredentialsError(f"permission denied by {where} ({_reason(error)}): {check}")


def _reason(error: BaseException | str) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."
