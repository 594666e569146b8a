"""Typed errors for bad requests. Each fails only its own request; the HTTP layer maps
`status` to the response code, the CLIs print the message. They live in encoders/, the
lowest layer that raises them, so no import runs from encoders/ back up to vlmserve/."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that cannot be served as given."""

    status: int = 400


class ImageDecodeError(RequestError):
    """An image that is corrupt, truncated, empty or in an unsupported format."""


class ImageTooLargeError(RequestError):
    status = 413


class TooManyImagesError(RequestError):
    """More images in one request than the configured limit."""


class PromptTooLongError(RequestError):
    """A prompt that leaves no room to generate within the model's context."""


class RetryableError(RequestError):
    """The server could not serve this request now, through no fault of the request: the
    same request may succeed if retried later (HTTP 503)."""

    status = 503


class ImageBusyError(RetryableError):
    """The decode pixel budget stayed full for the whole wait."""
