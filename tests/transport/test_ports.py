"""check_port: the one port check every config and flag goes through."""
import pytest

from transport.ports import check_port


@pytest.mark.parametrize("port", [0, 1, 8080, 65535])
def test_accepts_ports(port):
    assert check_port(port, "port") == port


@pytest.mark.parametrize("port", [-1, 65536, 1.5, "80", True, None])
def test_refuses_non_ports_naming_the_field(port):
    with pytest.raises(ValueError, match=r"^--http-port must be"):
        check_port(port, "--http-port")


def test_zero_can_be_refused_and_none_allowed():
    with pytest.raises(ValueError, match=r"\[1, 65535\]"):
        check_port(0, "metrics_port", allow_zero=False)
    assert check_port(None, "health_port", allow_none=True) is None
    assert check_port(5, "health_port", allow_none=True) == 5
