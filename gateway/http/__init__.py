"""HTTP on both sides of the gateway.

    server.py        HTTP/1.1 from clients: the protocol uvicorn runs through its `http=` option
    exchange.py      one request and its response on a client connection: ASGI receive and send
    flow_control.py  a client connection's reading and writing paused, and its send timeout
    early.py         the early answer's hook, and the turns a connection answered early sits out
    upgraded.py      UpgradedStream: a connection after 101, either side of a tunnel
    problem.py       problem+json answers
    request.py       read_request: one checked, normalized view of a request
    transport.py     LeanTransport: HTTP/1.1 to upstreams behind httpx's transport interface
"""
