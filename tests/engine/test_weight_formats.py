"""The weight formats (engine/weight_formats.py, float_formats.py, quant_formats.py) and the kernels' format enum.

Each format is chosen once per linear at load and then computes ``x W^T + b``: on pdserve's kernel where it runs,
through its plain-torch fallback elsewhere (``PDSERVE_CPU_KERNELS=0``, other devices, large products of row
formats). The enum of the formats the kernels read is defined once, in C++, and mirrored in Python only for
builds without the kernels: the two must agree, and a code C++ does not know must be refused, never guessed.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine import float_formats
from engine.float_formats import (Dense, Fp32Panels, Fp32Rows, OneDNN, fp32_rows_format, onednn_rows,
                                   packed_format)
from engine.kernels import cpu_kernels
from engine.quant import fake_quantize_act
from engine.quant_formats import (W4A8, W8A8, Int4, Int4Panels, Int8, Int8Panels, W4A8Panels, W8A8Panels,
                                  quantized_format)
from engine.weight_formats import WeightFormat

DISABLED = os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0"
N, K, GROUP = 96, 256, 64


@pytest.fixture(scope="module")
def kern():
    if DISABLED:
        pytest.skip("PDSERVE_CPU_KERNELS=0")
    k = cpu_kernels()
    assert k is not None, "pdserve's CPU kernels did not build (see the warning logged by engine.kernels)"
    return k


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g), torch.randn(N, generator=g), torch.randn(80, K, generator=g)


def test_the_python_mirror_is_the_kernels_enum(kern):
    assert {n: int(v) for n, v in kern.WeightFormat.__members__.items()} == {f.name: int(f) for f in WeightFormat}


def test_a_format_code_the_kernels_do_not_know_is_refused(kern):
    """The fused layer's switch has no silent default: an unknown code is an error at construction."""
    w = torch.randn(64, 64)
    good = (kern.WeightFormat.FP32_ROWS, w, None, None, 0, 64)
    bad = (kern.WeightFormat(42), w, torch.ones(64), None, 0, 64)
    norm = torch.ones(64)
    args = (norm, norm, 1e-5, 4, 4, 16, 0, 0.25, kern.PanelPrefetch())
    kern.DecodeLayer(good, good, (kern.WeightFormat.FP32_ROWS, torch.randn(128, 64), None, None, 0, 128), good, *args)
    with pytest.raises(RuntimeError, match="weight format 42"):
        kern.DecodeLayer(bad, good, good, good, *args)
    with pytest.raises(TypeError):  # a bare int is not a format
        kern.DecodeLayer((4, w, torch.ones(64), None, 0, 64), good, good, good, *args)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "w4a8"])
def test_without_kernels_each_quantized_format_is_its_dense_weight_through_torch(method):
    w, b, x = _weights(1)
    fmt = quantized_format(method, w, b, GROUP, kern=None)
    assert type(fmt) is {"int8": Int8, "int4": Int4, "w8a8": W8A8, "w4a8": W4A8}[method]
    assert fmt.method == method and not fmt.on_kernels() and fmt.tune_product() is None
    xa = fake_quantize_act(x) if method in ("w8a8", "w4a8") else x
    assert torch.equal(fmt(x), F.linear(xa, fmt.dense(), b))
    # and that weight is w, within the format's rounding
    err = (fmt.dense() - w).abs().max() / w.abs().max()
    assert err < (0.01 if method in ("int8", "w8a8") else 0.2), err.item()
    with pytest.raises(ValueError, match="fused decode layer"):
        fmt.fused_spec()


def test_unknown_quantizations_and_unblockable_layers_are_refused():
    w = torch.randn(8, 48)
    with pytest.raises(ValueError, match="blocks of 32"):
        quantized_format("w8a8", w, None, 32, kern=None)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantized_format("int3", torch.randn(8, 64), None, 32, kern=None)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8", "w4a8"])
def test_with_kernels_each_quantized_format_runs_the_kernel_and_falls_back_to_the_same_product(kern, method):
    w, b, x = _weights(2)
    fmt = quantized_format(method, w, b, GROUP, kern=kern, prefetch=kern.PanelPrefetch())
    panels = method in ("int8", "int4") or kern.qpanel_width() > 0
    want = {("int8", True): Int8Panels, ("int4", True): Int4Panels, ("w8a8", True): W8A8Panels,
            ("w4a8", True): W4A8Panels, ("w8a8", False): W8A8, ("w4a8", False): W4A8}[(method, panels)]
    assert type(fmt) is want and fmt.panels == panels
    if fmt.kern is None:
        pytest.skip(f"{method}: the row kernel does not take this layer on this build")
    assert fmt.on_kernels() and int(fmt.fused_spec()[0]) == int(fmt.code)
    assert (fmt.tune_product() is not None) == panels
    x = x if fmt.panels else x[:fmt.small_m]  # row formats: the kernel up to small_m rows, a GEMM above
    y = fmt(x)
    assert torch.equal(fmt(x[:1]), y[:1])  # a row has the same bits whatever its batch
    xa = fake_quantize_act(x) if method in ("w8a8", "w4a8") else x
    if getattr(fmt, "order", None) is not None:
        xa = xa[:, fmt.order]
    torch.testing.assert_close(y, F.linear(xa, fmt.dense(), b), rtol=1e-4, atol=1e-3)
    fmt.kern = None  # the fallback: the same product through torch
    torch.testing.assert_close(fmt(x), y, rtol=1e-4, atol=1e-3)


def test_float_formats(kern):
    w, b, x = _weights(3)
    ref = F.linear(x, w, b)
    rows = fp32_rows_format(w, b, kern)
    assert type(rows) is Fp32Rows and rows.small_m == 32 and rows.on_kernels()
    torch.testing.assert_close(rows(x[:8]), ref[:8], rtol=1e-5, atol=1e-4)  # the kernel
    torch.testing.assert_close(rows(x), ref, rtol=1e-5, atol=1e-4)  # 80 rows: one GEMM
    packed = packed_format(w, b, kern, kern.PanelPrefetch())
    assert type(packed) is Fp32Panels, "torch 2.13's oneDNN packs in panels on AVX2 / AVX-512"
    assert packed.on_kernels() and int(packed.fused_spec()[0]) == int(WeightFormat.FP32_PANELS)
    torch.testing.assert_close(packed(x[:8]), ref[:8], rtol=1e-5, atol=1e-4)  # linear_panel
    torch.testing.assert_close(packed(x), ref, rtol=1e-5, atol=1e-4)  # 80 rows: oneDNN
    only = packed_format(w, b, None, None)
    assert type(only) is OneDNN and not only.on_kernels() and only.tune_product() is None
    torch.testing.assert_close(only(x), ref, rtol=1e-5, atol=1e-4)
    dense = Dense(w.t().contiguous(), b)
    assert not dense.on_kernels()
    torch.testing.assert_close(dense(x), ref, rtol=1e-5, atol=1e-4)


# -- oneDNN row buckets (docs/reliability.md, the prefill workers' RSS growth) ---------------------------------

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def test_onednn_row_buckets_are_few_and_pad_little():
    assert [onednn_rows(m) for m in (1, 2, 63, 64)] == [1, 2, 63, 64]  # decode batches: their own row count
    assert [onednn_rows(m) for m in (65, 72, 73, 200, 300, 1500, 2048)] == [72, 72, 80, 208, 320, 1536, 2048]
    for m in range(1, 4097):
        assert m <= onednn_rows(m) <= m * 1.125
    assert len({onednn_rows(m) for m in range(65, 2049)}) == 40


@needs_onednn
def test_onednn_products_run_at_a_bounded_set_of_row_counts(monkeypatch):
    """torch's oneDNN linear caches a primitive per row count (two LRU caches of 1024 entries, ~0.6 MiB each):
    a prefill product's rows are the step's prompt tokens, so every prompt length used to be a new primitive.
    Every product now reaches oneDNN at one of a few bucketed row counts, with the caller's rows back."""
    w, b, _ = _weights(4)
    seen: list[int] = []

    def fake(x, packed, bias):
        seen.append(x.shape[0])
        return x.new_zeros(x.shape[0], N)

    monkeypatch.setattr(float_formats, "_linear_pointwise", fake)
    fmt = packed_format(w, b, None, None)
    assert type(fmt) is OneDNN
    for m in range(1, 2049):
        assert fmt(torch.zeros(m, K)).shape == (m, N)
    assert len(seen) == 2048 and len(set(seen)) <= 64 + 40


@needs_onednn
def test_onednn_padded_rows_give_each_row_the_same_bits(kern):
    """Zero rows up to the bucket change no bit of the real rows (outputs stay token-identical)."""
    w, b, _ = _weights(5)
    g = torch.Generator().manual_seed(6)
    for fmt in (packed_format(w, b, None, None), packed_format(w, b, kern, kern.PanelPrefetch())):
        for m in (65, 73, 100, 129, 257, 300, 513):
            x = torch.randn(m, K, generator=g)
            exact = torch.ops.mkldnn._linear_pointwise(x, fmt.packed, fmt.bias, "none", [], "")
            assert torch.equal(fmt(x), exact), m
            assert torch.equal(fmt(x.view(1, m, K)), exact.view(1, m, N))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@needs_onednn
def test_onednn_products_of_many_row_counts_do_not_grow_rss():
    """200 distinct row counts (65..463) through one oneDNN layer: +127 MiB of RSS before the buckets (a cached
    primitive per count), +15 MiB with them (22 buckets), measured on the 2-core box."""
    w, b, _ = _weights(7)
    fmt = packed_format(w, b, None, None)
    fmt(torch.zeros(1000, K))
    before = _rss_mib()
    for m in range(65, 465, 2):
        fmt(torch.zeros(m, K))
    assert _rss_mib() - before < 50
