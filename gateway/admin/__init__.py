"""The admin port (gateway/admin/app.py)."""

from gateway.admin.app import admin_app

__all__ = ["admin_app"]
