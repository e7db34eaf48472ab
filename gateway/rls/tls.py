"""The RLS port's TLS context, apart from the server so that the command line reads it cheaply."""

from __future__ import annotations

import ssl


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    """The RLS port's TLS (--rls-tls-cert/--rls-tls-key): TLS 1.2 or newer, HTTP/2 by ALPN, as gRPC
    asks. Raises OSError or ssl.SSLError for a certificate or key that cannot be used."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"])
    return context
