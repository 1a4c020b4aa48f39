"""Protocol buffers: the public API (pdserve.proto) and the internal worker API.

Generated modules (``*_pb2.py``, ``*_pb2_grpc.py``, ``*.pyi``) are committed
beside the ``.proto`` files; regenerate with ``python -m proto.generate`` and
``tests/proto/test_generated_fresh.py`` fails when they are stale.
"""
