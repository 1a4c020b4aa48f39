"""``pdserve up`` argument checks: fields the configs own are checked by the configs and named by flag."""
from __future__ import annotations

import pytest

from cluster.cli import _check_up_args, build_parser


@pytest.mark.parametrize("argv, flag", [
    (["--local-prefill-max-tokens", "-1"], "--local-prefill-max-tokens"),
    (["--prefill-queue-max-tokens", "-3"], "--prefill-queue-max-tokens"),
    (["--num-kv-blocks", "0"], "--num-kv-blocks"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--prefill", "-1"], "--prefill"),
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
