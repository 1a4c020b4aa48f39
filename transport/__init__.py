"""The bottom layer both sides of every wire share: ports, TLS files, bearer auth, gRPC serving.

Lifecycle: nothing here holds state across calls; servers built from it (``GrpcServing``) are started and
stopped by their owner. It imports nothing of the project except ``proto``, so the router, the workers,
the load-test client and the cluster commands can all stand on it.
"""
