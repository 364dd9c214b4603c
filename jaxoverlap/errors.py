"""Errors raised for bad input, all ValueErrors (callers may catch one type), and for the
use of a closed engine."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given (empty prompt, bad ids, bad params)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the context (maps to gRPC RESOURCE_EXHAUSTED)."""


class QueueFullError(ValueError):
    """Too many queued requests (maps to gRPC RESOURCE_EXHAUSTED)."""


class EngineClosedError(RuntimeError):
    """The engine was closed (Engine.close): it holds no weights or cache any more."""
