"""The front's network servers, which every request and every token passes: the gRPC server
(`grpc_server.py`) on grpc.aio, with the call acceptor that takes new calls in ahead
(`call_acceptor.py`) and the filter that counts sends a leaving client made fail
(`failed_sends.py`), or as an ASGI app that Envoy serves (`asgi_grpc.py`, `--grpc-server
native`); and the HTTP server (`http_server.py`) whose port `http_listener.py` accepts a whole
burst at a time. They serve the protocol adapters (`cadence.api`); what starts and stops them
is `cadence.lifecycle`."""
