"""``pdserve up`` argument checks: fields the configs own are checked by the configs and named by flag."""
from __future__ import annotations

import pytest

from cluster.cli import _check_up_args, _router_overrides, build_parser


@pytest.mark.parametrize("argv, flag", [
    (["--local-prefill-max-tokens", "-1"], "--local-prefill-max-tokens"),
    (["--prefill-queue-max-tokens", "-3"], "--prefill-queue-max-tokens"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--prefill", "-1"], "--prefill"),
    (["--max-num-requests", "0"], "--max-num-requests"),
    (["--max-num-requests", "256"], "--max-num-requests"),  # must stay below the router's 256 RPC threads
    (["--check-interval", "0"], "--check-interval"),
])
def test_bad_flag_is_named(argv, flag):
    args = build_parser().parse_args(["up", *argv])
    with pytest.raises(ValueError) as e:
        _check_up_args(args)
    assert str(e.value).startswith(flag + " must be")


def test_defaults_pass():
    _check_up_args(build_parser().parse_args(["up"]))
    _check_up_args(build_parser().parse_args(["up", "--local-prefill-max-tokens", "128",
                                              "--prefill-queue-max-tokens", "0", "--num-kv-blocks", "64"]))


def test_max_num_requests_reaches_the_router_config():
    from router.config import RouterConfig

    if "max_num_requests" not in RouterConfig.__dataclass_fields__:
        pytest.skip("RouterConfig.max_num_requests not there yet (router rename in progress)")
    args = build_parser().parse_args(["up", "--max-num-requests", "100"])
    _check_up_args(args)
    overrides = _router_overrides(args)
    assert overrides["max_num_requests"] == 100
    assert RouterConfig(**overrides).max_num_requests == 100
    assert "max_num_requests" not in _router_overrides(build_parser().parse_args(["up"]))  # router default
