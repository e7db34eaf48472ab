"""HTTP on both sides of the gateway.

    server.py     HTTP/1.1 from clients: the protocol uvicorn runs through its `http=` option
    request.py    read_request: one checked, normalized view of a request
    transport.py  LeanTransport: HTTP/1.1 to upstreams behind httpx's transport interface
"""
