"""The errors of the engine client library, all subclasses of :class:`ClientError`."""

from __future__ import annotations

from schemas.reasons import Reason


class ClientError(Exception):
    """Base of everything this module raises on purpose."""


class RpcError(ClientError):
    """The daemon answered with an ``Error``: a refusal or a malformed request.

    ``code`` is the stable string from the wire; :attr:`reason` is the
    :class:`Reason` when the code is one (protocol codes such as
    ``bad_request`` are not).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def reason(self) -> Reason | None:
        try:
            return Reason(self.code)
        except ValueError:
            return None


class ConnectionLost(ClientError):
    """The connection is closed or broke; pending and later calls fail with this.

    ``daemon_error`` is the last ``Error`` the daemon sent that answered no
    call (id 0: a refused connection, an oversized frame), which usually says
    why it hung up.
    """

    def __init__(self, message: str, daemon_error: RpcError | None = None) -> None:
        if daemon_error is not None:
            message = f"{message} (daemon said {daemon_error})"
        super().__init__(message)
        self.daemon_error = daemon_error


class DaemonUnreachable(ConnectionLost):
    """Nobody listens on the socket (it is gone, or refuses): no daemon process serves it."""


class ProtocolError(ClientError):
    """The daemon sent something this client cannot accept (wrong reply kind,
    undecodable reply, unsupported protocol version)."""


class CallTimeout(ClientError, TimeoutError):
    """No reply (or event) within the timeout. Also a :class:`TimeoutError`."""


class RequestTooLarge(ClientError):
    """The encoded request exceeds the frame limit; it was not sent."""
