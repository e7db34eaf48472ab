"""The hop-by-hop fields (RFC 9110 section 7.6.1): a connection's, never forwarded, never an
identity. A leaf module: the HTTP code reads it, and so does the config loader, which refuses a rule
counting one."""

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection",
})
