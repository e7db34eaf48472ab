"""A rate-limiting reverse proxy: layered limits checked in one Redis Lua call, exact under concurrency."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["RateLimitMiddleware", "__version__"]

if TYPE_CHECKING:
    from gateway.middleware import RateLimitMiddleware


def __getattr__(name: str) -> Any:
    if name == "RateLimitMiddleware":  # imported on first use: the CLI does not need it
        from gateway.middleware import RateLimitMiddleware

        return RateLimitMiddleware
    raise AttributeError(name)
