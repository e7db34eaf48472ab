"""A rate-limiting reverse proxy: layered limits checked in one Redis Lua call."""

__version__ = "0.1.0"
