// pdserve CPU kernels: causal prefill attention (flash-style), over fresh K/V or the paged cache.
#include "kernels.h"

namespace pdserve {

// ---- causal prefill attention ------------------------------------------------------------------------
// n query rows of a prompt at positions off .. off + n - 1 over its nk = off + n keys (off = 0: a prompt with no
// cached context, K / V given as float32 [n, Hkv, D]; off > 0: a later chunk or a prefix-cache hit, K / V read from
// the paged cache through the block table, any cache dtype), causal, an optional sliding window (query i sees
// keys j with i - window < j <= i). Flash-style: a tile of PQ query rows of
// one head against blocks of PK keys, an online softmax per row, the scores and the output accumulated in
// registers through the same broadcast-FMA microkernel as the panel linears: K is transposed once per call to
// [Hkv, D, n] so a step over d is PK/16 contiguous key vectors times one broadcast per query row, and a step over
// keys is D/16 contiguous V vectors times one broadcast of each row's probability. Blocks past a tile's causal
// limit or before its window are skipped. Parallel over (query head, tile), head-major, so both threads get the
// same mix of short and long rows. Masked scores are -1e30 (finite under -ffast-math), whose exp is ~1e-38.
// K and V are first copied per KV head into contiguous float blocks (K as [Hkv, blocks, D, PK], V as [Hkv, nk, D];
// cache rows dequantized on the way): read in place, a block's rows sit a power of two apart (n * 4 or
// Hkv * D * 4 bytes) and crowd a few L1 sets.
constexpr int PQ = 6;    // query rows per tile
constexpr int PKV = 4;   // key vectors per block: PK = 64 keys
constexpr int PK = 16 * PKV;
constexpr float LAZY = 8.f;  // see the online softmax in prefill_tile

template <int DVC>
void prefill_tile(const float* q, int64_t qrow, const float* kt, const float* v, float* out, int64_t n, int64_t off,
                  int64_t H, int64_t Hkv, int64_t D, int64_t np, int64_t hq, int64_t i0, int64_t window, float scale) {
  const int64_t G = H / Hkv, h = hq / G, DV = DVC ? DVC : D / 16;
  const float* kth = kt + h * D * np;  // [np / PK, D, PK]
  const float* vh = v + h * np * D;     // [np, D]
  int64_t pos[PQ];
  for (int r = 0; r < PQ; ++r) pos[r] = off + std::min<int64_t>(i0 + r, n - 1);  // rows past n repeat the last one
  const int64_t hi = pos[PQ - 1] + 1;                                     // keys [lo, hi) matter to this tile
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[0] - window + 1) : 0;
  float qs[PQ][256];  // the tile's query rows, pre-scaled (D <= 256)
  for (int r = 0; r < PQ; ++r)
    for (int64_t d = 0; d < D; ++d) qs[r][d] = q[(pos[r] - off) * qrow + hq * D + d] * scale;
  float m[PQ];
  v16f lv[PQ];
  alignas(64) float o[PQ][256];
  alignas(64) float p[PQ][PK];
  for (int r = 0; r < PQ; ++r) {
    m[r] = -1e30f; lv[r] = v16f{};
    for (int64_t d = 0; d < D; ++d) o[r][d] = 0.f;
  }
  for (int64_t j0 = lo / PK * PK; j0 < hi; j0 += PK) {
    // scores of PQ rows x PK keys
    v16f s[PQ][PKV];
    for (int r = 0; r < PQ; ++r)
      for (int c = 0; c < PKV; ++c) s[r][c] = v16f{};
    for (int64_t d = 0; d < D; ++d) {
      v16f kv[PKV];
      for (int c = 0; c < PKV; ++c) kv[c] = load<v16f>(kth + (j0 * D + d * PK) + 16 * c);
      for (int r = 0; r < PQ; ++r) {
        const v16f qb = splat<v16f>(qs[r][d]);
        for (int c = 0; c < PKV; ++c) s[r][c] += qb * kv[c];
      }
    }
    // Masks only on blocks that cross the diagonal or the window's start.
    if (j0 + PK > pos[0] + 1 || (window > 0 && j0 <= pos[PQ - 1] - window))
      for (int r = 0; r < PQ; ++r) {
        for (int c = 0; c < PKV; ++c) store(p[r] + 16 * c, s[r][c]);
        for (int j = 0; j < PK; ++j) {
          const int64_t key = j0 + j;
          if (key > pos[r] || (window > 0 && key <= pos[r] - window)) p[r][j] = -1e30f;
        }
        for (int c = 0; c < PKV; ++c) s[r][c] = load<v16f>(p[r] + 16 * c);
      }
    // Online softmax with a lazy maximum: a row's reference m moves (rescaling l and o) only when a score
    // exceeds it by more than LAZY, so most blocks skip the rescale; exp(s - m) <= e^LAZY keeps l and o far
    // from overflow, and o / l is unchanged by which m was used. l is kept per lane, summed at the end.
    for (int r = 0; r < PQ; ++r) {
      v16f mv = s[r][0];
      for (int c = 1; c < PKV; ++c) mv = vmax(mv, s[r][c]);
      const float bm = hmax(mv);
      if (bm > m[r] + LAZY) {
        const float alpha = std::exp(m[r] - bm);
        m[r] = bm;
        lv[r] = lv[r] * alpha;
        for (int64_t dv = 0; dv < DV; ++dv) store(o[r] + 16 * dv, load<v16f>(o[r] + 16 * dv) * alpha);
      }
      const v16f mr = splat<v16f>(m[r]);
      for (int c = 0; c < PKV; ++c) {
        const v16f e = exp16(s[r][c] - mr);
        store(p[r] + 16 * c, e);
        lv[r] += e;
      }
    }
    // o += p v over the block's keys (those below off + n), D/16 vectors at a time in chunks of 4
    const int64_t nk = std::min<int64_t>(PK, off + n - j0);
    for (int64_t dc = 0; dc < DV; dc += 4) {
      const int nv = (int)std::min<int64_t>(4, DV - dc);
      v16f a[PQ][4];
      for (int r = 0; r < PQ; ++r)
        for (int c = 0; c < nv; ++c) a[r][c] = load<v16f>(o[r] + 16 * (dc + c));
      for (int64_t j = 0; j < nk; ++j) {
        const float* vr = vh + (j0 + j) * D + 16 * dc;
        v16f vv[4];
        for (int c = 0; c < nv; ++c) vv[c] = load<v16f>(vr + 16 * c);
        for (int r = 0; r < PQ; ++r) {
          const v16f pb = splat<v16f>(p[r][j]);
          for (int c = 0; c < nv; ++c) a[r][c] += pb * vv[c];
        }
      }
      for (int r = 0; r < PQ; ++r)
        for (int c = 0; c < nv; ++c) store(o[r] + 16 * (dc + c), a[r][c]);
    }
  }
  for (int r = 0; r < PQ && i0 + r < n; ++r) {
    const float inv = 1.f / hsum(lv[r]);
    for (int64_t dv = 0; dv < DV; ++dv)
      store(out + ((i0 + r) * H + hq) * D + 16 * dv, load<v16f>(o[r] + 16 * dv) * inv);
  }
}

// [n, heads, D] float32 whose heads sit back to back in each token's row; the rows themselves may be strided (q, k
// and v as views into one qkv projection output), which saves three copies per layer.
bool heads_in_rows(const torch::Tensor& t) {
  return t.dim() == 3 && t.device().is_cpu() && t.scalar_type() == torch::kFloat && (t.size(2) <= 1 || t.stride(2) == 1) &&
         (t.size(1) <= 1 || t.stride(1) == t.size(2)) && (t.size(0) <= 1 || t.stride(0) >= t.size(1) * t.size(2));
}

// The shared body: q [n, H, D] (heads contiguous, rows strided) at positions off.., keys [0, off + n) of Hkv heads,
// fetch(j, h, k_dst, v_dst) writing key j's K and V rows of head h as D floats.
template <class Fetch>
torch::Tensor prefill_core(const torch::Tensor& q, int64_t off, int64_t Hkv, int64_t window, double sm_scale, Fetch fetch) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), nk = off + n, qrow = q.stride(0);
  auto out = torch::empty({n, H, D}, q.options());
  if (n == 0) return out;
  const int64_t np = (nk + PK - 1) / PK * PK;  // keys padded to whole blocks (zeros; masked)
  auto kt = torch::zeros({Hkv, np / PK, D, PK}, q.options());
  auto vt = torch::zeros({Hkv, np, D}, q.options());
  float* ktp = kt.data_ptr<float>(); float* vtp = vt.data_ptr<float>();
  at::parallel_for(0, Hkv * (np / PK), 1, [&](int64_t a, int64_t b) {
    alignas(64) float kr[256];
    for (int64_t hb = a; hb < b; ++hb) {
      const int64_t h = hb / (np / PK), j0 = (hb % (np / PK)) * PK;
      for (int64_t j = j0; j < std::min(nk, j0 + PK); ++j) {
        fetch(j, h, kr, vtp + (h * np + j) * D);
        for (int64_t d = 0; d < D; ++d) ktp[(hb * D + d) * PK + (j - j0)] = kr[d];
      }
    }
  });
  const float* qp = q.data_ptr<float>(); const float* vp = vtp; float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);
  const int64_t tiles = (n + PQ - 1) / PQ;
  at::parallel_for(0, H * tiles, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int64_t hq = t / tiles, i0 = (t % tiles) * PQ;
      if (D == 64) prefill_tile<4>(qp, qrow, ktp, vp, op, n, off, H, Hkv, D, np, hq, i0, window, scale);
      else if (D == 128) prefill_tile<8>(qp, qrow, ktp, vp, op, n, off, H, Hkv, D, np, hq, i0, window, scale);
      else prefill_tile<0>(qp, qrow, ktp, vp, op, n, off, H, Hkv, D, np, hq, i0, window, scale);
    }
  });
  return out;
}

void check_prefill_q(const torch::Tensor& q, int64_t Hkv, int64_t window) {
  TORCH_CHECK(heads_in_rows(q), "q must be CPU float32 [n, H, D] with each token's heads contiguous (rows may be strided)");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 256, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(Hkv > 0 && q.size(1) % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = none)");
}

torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t window, double sm_scale) {
  TORCH_CHECK(heads_in_rows(k) && heads_in_rows(v) && k.sizes() == v.sizes(),
              "k and v must be CPU float32 [n, Hkv, D] of one shape with each token's heads contiguous");
  check_prefill_q(q, k.size(1), window);
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == D, "k/v must have q's tokens and head_dim");
  const float* kp = k.data_ptr<float>(); const float* vp = v.data_ptr<float>();
  const int64_t krow = k.stride(0), vrow = v.stride(0);
  return prefill_core(q, 0, k.size(1), window, sm_scale, [&](int64_t j, int64_t h, float* kd, float* vd) {
    std::memcpy(kd, kp + j * krow + h * D, D * sizeof(float));
    std::memcpy(vd, vp + j * vrow + h * D, D * sizeof(float));
  });
}

// The chunk's own K/V must already be in the cache (engine/attention.py writes them first).
torch::Tensor prefill_attention_paged(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_table, int64_t ctx_len, int64_t window, double sm_scale) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.device().is_cpu() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous CPU [num_blocks, block_size, Hkv, Dp] of one dtype");
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), Dp = k_cache.size(3);
  check_prefill_q(q, Hkv, window);
  const int64_t n = q.size(0), D = q.size(2);
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table must be contiguous int64 [blocks]");
  TORCH_CHECK(ctx_len >= n, "ctx_len must be at least q's tokens (they are the context's last ones)");
  TORCH_CHECK(bs > 0 && (ctx_len + bs - 1) / bs <= block_table.numel(), "block_table must cover ctx_len tokens");
  const int64_t* bt = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (ctx_len + bs - 1) / bs; ++i) TORCH_CHECK(bt[i] >= 0 && bt[i] < NB, "block id out of range");
  const KV kind = kv_kind(k_cache, D);
  const int64_t esize = k_cache.element_size();
  const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
  const int64_t row_bytes = Dp * esize;
  auto run = [&](auto kind_c) {
    using R = Row<decltype(kind_c)::value>;
    return prefill_core(q, ctx_len - n, Hkv, window, sm_scale, [&](int64_t j, int64_t h, float* kd, float* vd) {
      const int64_t row = ((bt[j / bs] * bs + j % bs) * Hkv + h) * row_bytes;
      const R kr{kb + row, D}, vr{vb + row, D};
      const float ks = kr.scale(), vs = vr.scale();  // int8 rows: q * s, as engine/quant.py dequantize_kv
      for (int64_t d = 0; d < D; d += 16) {
        store(kd + d, kr.at(d) * ks);
        store(vd + d, vr.at(d) * vs);
      }
    });
  };
  if (kind == KV::F32) return run(std::integral_constant<KV, KV::F32>{});
  if (kind == KV::BF16) return run(std::integral_constant<KV, KV::BF16>{});
  return run(std::integral_constant<KV, KV::I8>{});
}

}  // namespace pdserve
