// pdserve CPU kernels: the Python module. engine/kernels.py builds it; engine/weight_formats.py reads its
// WeightFormat enum; a CausalLM holds one PanelPrefetch and passes it to its panel kernel calls and fused layers.
#include "kernels.h"
#include "decode_layer.h"

using namespace pdserve;
namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::enum_<WeightFormat>(m, "WeightFormat", "a linear layer's weight format as the kernels read it (decode_layer.h)")
      .value("FP32_ROWS", WeightFormat::FP32_ROWS)
      .value("INT8_ROWS", WeightFormat::INT8_ROWS)
      .value("INT4_ROWS", WeightFormat::INT4_ROWS)
      .value("W8A8_ROWS", WeightFormat::W8A8_ROWS)
      .value("W4A8_ROWS", WeightFormat::W4A8_ROWS)
      .value("FP32_PANELS", WeightFormat::FP32_PANELS)
      .value("W8A8_PANELS", WeightFormat::W8A8_PANELS)
      .value("W4A8_PANELS", WeightFormat::W4A8_PANELS)
      .value("INT8_PANELS", WeightFormat::INT8_PANELS)
      .value("INT4_PANELS", WeightFormat::INT4_PANELS);
  m.def("format_built", &format_built, "whether this build has the kernel of a weight format");
  py::class_<PanelPrefetch, std::shared_ptr<PanelPrefetch>>(
      m, "PanelPrefetch", "bytes of its weight stream a panel tile prefetches ahead: for one input row, for several "
                          "(0 = none); one per loaded model (engine/prefetch_tuning.py)")
      .def(py::init([](int64_t one_row, int64_t rows) {
             TORCH_CHECK(one_row >= 0 && rows >= 0, "prefetch distances must be >= 0 bytes");
             return std::make_shared<PanelPrefetch>(PanelPrefetch{one_row, rows});
           }), py::arg("one_row") = 0, py::arg("rows") = 0)
      .def("set", [](PanelPrefetch& p, int64_t one_row, int64_t rows) {
             TORCH_CHECK(one_row >= 0 && rows >= 0, "prefetch distances must be >= 0 bytes");
             p.one_row = one_row; p.rows = rows;
           }, "set the (one row, several rows) distances in bytes")
      .def("get", [](const PanelPrefetch& p) { return std::make_pair(p.one_row, p.rows); },
           "the (one row, several rows) distances in bytes");
  const auto no_pf = py::arg("prefetch") = PanelPrefetch{};
  m.def("linear_fp32", &linear_fp32, "y = x w^T (+ bias), w float32 [N, K]");
  m.def("linear_int4_panels", &linear_int4_panels, "int4 weight-only in panels [NP, K, B/2] with group scales [NP, K/G, B]",
        py::arg("x"), py::arg("p"), py::arg("scale"), py::arg("N"), py::arg("group"), py::arg("bias"), no_pf);
  m.def("linear_int8_panels", &linear_int8_panels, "int8 weight-only in panels [NP, K, B] with scale [NP * B]",
        py::arg("x"), py::arg("p"), py::arg("scale"), py::arg("N"), py::arg("bias"), no_pf);
  m.def("linear_panel", &linear_panel, "y = x W^T (+ bias), W float32 in oneDNN's panels [NP, K, B] (see panels.cpp)",
        py::arg("x"), py::arg("p"), py::arg("N"), py::arg("bias"), no_pf);
  m.def("linear_int8", &linear_int8, "y = x (w * scale)^T (+ bias), w int8 [N, K], scale [N]");
  m.def("linear_int4", &linear_int4, "y = x W^T (+ bias), W int4 group-wise (see linear_rows.cpp)");
  m.def("linear_w8a8", &linear_w8a8, "y = x (w * scale)^T (+ bias), w in step order, x rounded to int8 per 32 values");
  m.def("linear_w4a8", &linear_w4a8, "int4 group-wise W (see linear_rows.cpp) with x rounded to int8 per 32 values");
  m.def("linear_w8a8_panels", &linear_w8a8_panels,
        "w8a8 with the weights in the integer panel format (see int_dots.cpp; builds where qpanel_width() > 0)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("N"), py::arg("bias"), no_pf);
  m.def("linear_w4a8_panels", &linear_w4a8_panels,
        "w4a8 with the weights in the integer panel format (see int_dots.cpp; builds where qpanel_width() > 0)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("N"), py::arg("group"), py::arg("bias"), no_pf);
  m.def("qpanel_width", &qpanel_width, "outputs per panel of the integer panel kernels, 0 where not built");
  m.def("qpanel_unsigned", &qpanel_unsigned, "whether w8a8 panels store q ^ 0x80 (the VNNI builds)");
  m.def("qstep", &qstep, "values per step of linear_w8a8 / linear_w4a8 (see int_dots.cpp)");
  m.def("rms_norm", &rms_norm, "w * x / sqrt(mean(x^2) + eps) per row, float32");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from gate_up [M, 2I], float32");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up from gate_up [M, 2I], float32 (Gemma's GeGLU)");
  py::class_<DecodeLayer>(m, "DecodeLayer")
      .def(py::init<const KLinearSpec&, const KLinearSpec&, const KLinearSpec&, const KLinearSpec&, torch::Tensor,
                    torch::Tensor, double, int64_t, int64_t, int64_t, int64_t, double, std::shared_ptr<PanelPrefetch>,
                    c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, bool>(),
           "(qkv, o, gate_up, down, in_norm, post_norm, eps, H, Hkv, D, window, sm_scale, prefetch, q_norm, k_norm, "
           "attn_out_norm, mlp_out_norm, gelu); a linear is (WeightFormat, w, scale or None, bias or None, group, N); "
           "q_norm / k_norm None but for Qwen3's and Gemma 3's per-head norms, attn_out_norm / mlp_out_norm None but "
           "for Gemma 3's norms of the attention and MLP outputs; gelu: GeGLU instead of SwiGLU",
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("in_norm"), py::arg("post_norm"),
           py::arg("eps"), py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("window"), py::arg("sm_scale"),
           py::arg("prefetch"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(), py::arg("gelu") = false)
      .def("forward", &DecodeLayer::forward, "one decoder layer for T single-token decodes (see decode_layer.cpp)");
  m.def("rope_", &rope_, "RoPE in place on the first heads of x [T, Hx, D] float32 (see norm_act.cpp)");
  m.def("lora_apply_", &lora_apply_, "y[t, lo_k:] += (x[t] A_k^T) B_k for the rows t of each piece's slot (lora.cpp)");
  m.def("prefill_attention_paged", &prefill_attention_paged,
        "(q [n, H, D], k_cache, v_cache, block_table, ctx_len, window, scale): the context's last n queries over "
        "its ctx_len cached keys (see prefill_attention.cpp)");
  m.def("prefill_attention", &prefill_attention,
        "(q [n, H, D], k / v [n, Hkv, D], window, scale): causal attention of a prompt over itself, float32");
  m.def("paged_decode_attention", &paged_decode_attention,
        "one query per sequence over its paged K/V read in place through the block table");
}
