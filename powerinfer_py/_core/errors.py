"""The error type of the C core and the names of its status codes.

`PowerInferError` is the exception every failure reported by libpowerinfer becomes
(exported as `powerinfer_py.PowerInferError`). `core_error(what)` builds one from the
core's thread-local last error, right after a call failed.
"""

from __future__ import annotations

from typing import Dict, Optional

from .bindings import ffi, last_error, last_status

# enum powerinfer_status, read from the header: value -> name and name -> value.
STATUS_NAMES: Dict[int, str] = dict(ffi.typeof("enum powerinfer_status").elements)
STATUS_CODES: Dict[str, int] = dict(ffi.typeof("enum powerinfer_status").relements)
OK = STATUS_CODES["POWERINFER_OK"]
ERR_UNSUPPORTED = STATUS_CODES["POWERINFER_ERR_UNSUPPORTED"]
ERR_ABORTED = STATUS_CODES["POWERINFER_ERR_ABORTED"]


def status_name(status: Optional[int]) -> str:
    """"POWERINFER_ERR_IO", ... for a status code (the number itself if unknown)."""
    return STATUS_NAMES.get(status, str(status)) if status is not None else "unknown status"


class PowerInferError(ValueError, RuntimeError):
    """A failure reported by the C core, with its message from powerinfer_last_error().

    It is both a ValueError and a RuntimeError so code written for llama-cpp-python
    (ValueError when a model fails to load, RuntimeError when a decode fails)
    catches it unchanged. `status` is the core's powerinfer_status code when known,
    `status_name` its name; `core_message` is the core's own message, without the
    context this package puts before it.
    """

    def __init__(self, message: str, status: Optional[int] = None, core_message: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.core_message = message if core_message is None else core_message

    @property
    def status_name(self) -> Optional[str]:
        """The name of `status` ("POWERINFER_ERR_INVALID_ARG", ...), None when unknown."""
        return STATUS_NAMES.get(self.status) if self.status is not None else None


def core_error(what: str, status: Optional[int] = None) -> PowerInferError:
    """The error of a core call that just failed: "<what>: <core message>", with the
    status the call returned (named in the message) or else the core's last status."""
    message = last_error() or "no message from the core"
    if status is not None:
        return PowerInferError(f"{what} ({status_name(status)}): {message}", status, message)
    return PowerInferError(f"{what}: {message}", last_status(), message)
