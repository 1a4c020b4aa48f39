"""A router killed with connections open can be restarted on its port at once (as a Deployment restarts it).

The killed process's accepted connections stay in TIME_WAIT for a minute on the port; the servers bind with
SO_REUSEADDR, so the port is usable, and ``pdserve``'s early port check (``check_port_free``) must agree. Found by
the deployment soak (benchmarks/soak/deployment.py): a router restarted 5 s after its kill -9 exited with "--port ...
is not available: Address already in use".
"""
from __future__ import annotations

import socket

import pytest

from cluster.up_checks import check_port_free


def test_a_port_with_time_wait_connections_is_free_but_a_listened_one_is_not():
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    with pytest.raises(ValueError, match=f"--port {port}"):
        check_port_free("127.0.0.1", port)  # listening: taken
    conn.close()  # the server side closes first: its end of the connection waits in TIME_WAIT on the port
    client.close()
    server.close()
    check_port_free("127.0.0.1", port)
