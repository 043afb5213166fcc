"""Failures as gRPC status codes: the same errors as the HTTP API's, with the same messages."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from service.openai.errors import from_exception

T = TypeVar("T")

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    api_error = from_exception(error)
    return CODES.get(api_error.status, grpc.StatusCode.INTERNAL), api_error.message


def unary(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary handler whose exceptions end the call with their status code."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await context.abort(*status_of(error))
            raise  # abort() raises; this line only satisfies the type checker

    return handler


def streaming(method: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """A server-streaming handler whose exceptions end the stream with their status code."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[T]:
        try:
            async for item in method(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as error:
            await context.abort(*status_of(error))

    return handler
