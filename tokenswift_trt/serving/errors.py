"""Who failed: the server-side causes a request can end with, and the status every front answers.

A client's mistake is a `RequestError` (handler.py): HTTP 400, gRPC INVALID_ARGUMENT, its message
naming the field. A failure of the server is a `ServerFault` with one of the causes below; its message
starts with the cause ("server busy: ..."), because Triton's HTTP generate endpoints answer every model
error with 400 whatever its code: the HTTP front and the OpenAI front read the cause back from the
message and answer with its status (and `Retry-After` where waiting helps). gRPC clients get the code
the model sends (UNAVAILABLE or INTERNAL). The metrics count failures by the cause's `reason`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    words: str  # how the message starts: "<words>: <details>"
    reason: str  # metrics label and OpenAI error code
    status: int  # HTTP status
    retry_after_s: int | None = None  # Retry-After, where the same request may succeed later


BUSY = Cause("server busy", "server_busy", 503, retry_after_s=5)
SHUTTING_DOWN = Cause("server shutting down", "server_shutdown", 503, retry_after_s=10)
HELD = Cause("request running elsewhere", "request_running_elsewhere", 503, retry_after_s=30)
OUT_OF_MEMORY = Cause("out of memory", "out_of_memory", 503, retry_after_s=30)
FAILED = Cause("generation failed", "generation_failed", 500)
CAUSES = (BUSY, SHUTTING_DOWN, HELD, OUT_OF_MEMORY, FAILED)
INVALID = "invalid_request"  # the metrics reason of a client's mistake


class ServerFault(RuntimeError):
    """A request the server could not serve; str() is the message clients see ("<cause>: <details>")."""

    def __init__(self, cause: Cause, details: str) -> None:
        super().__init__(f"{cause.words}: {details}")
        self.cause = cause


def cause_of(message: str) -> Cause | None:
    """The cause a server fault's message starts with (None: not a server fault)."""
    return next((cause for cause in CAUSES if message.startswith(f"{cause.words}: ")), None)


def fault_of(error: BaseException) -> ServerFault:
    """What generation failed with, as a server fault: out of memory named as such, the rest as
    "generation failed"."""
    if isinstance(error, ServerFault):
        return error
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":  # torch's CUDA OOM
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return ServerFault(OUT_OF_MEMORY, f"{first} (retry when fewer requests run, or lower --max-batch)")
    return ServerFault(FAILED, str(error) or type(error).__name__)
