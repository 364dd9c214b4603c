"""Errors raised for bad input. All are ValueErrors, so callers may catch one type."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given (empty prompt, bad ids, bad params)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the context (maps to gRPC RESOURCE_EXHAUSTED)."""


class QueueFullError(ValueError):
    """Too many queued requests (maps to gRPC RESOURCE_EXHAUSTED)."""
