// pdserve CPU kernels: paged decode attention (one query per sequence over its cached K/V, read in place).
#include "kernels.h"

namespace pdserve {

// ---- paged decode attention ----------------------------------------------------------------------

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor ctx_lens, int64_t window,
                                     double sm_scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32 [B, H, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, Dp] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int64 [B, max_blocks]");
  TORCH_CHECK(ctx_lens.scalar_type() == torch::kLong && ctx_lens.is_contiguous(), "ctx_lens must be int64 [B]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2), Dp = k_cache.size(3);
  const int64_t maxb = block_tables.size(1);
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) == B && ctx_lens.numel() == B, "block_tables/ctx_lens must have B rows");
  const KV kind = kv_kind(k_cache, D);
  const int64_t esize = k_cache.element_size();
  const int64_t G = H / Hkv, row_bytes = Dp * esize;
  const auto* kb = static_cast<const uint8_t*>(k_cache.data_ptr());
  const auto* vb = static_cast<const uint8_t*>(v_cache.data_ptr());
  const auto* bt = block_tables.data_ptr<int64_t>();
  const auto* lens = ctx_lens.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  auto out = torch::empty_like(q);
  float* op = out.data_ptr<float>();
  const float scale = static_cast<float>(sm_scale);

  for (int64_t b = 0; b < B; ++b) {  // validate once, so the hot loops index without checks
    const int64_t ctx = lens[b];
    TORCH_CHECK(ctx >= 1 && (ctx + bs - 1) / bs <= maxb, "ctx_lens out of range of the block table");
    for (int64_t i = 0; i < (ctx + bs - 1) / bs; ++i)
      TORCH_CHECK(bt[b * maxb + i] >= 0 && bt[b * maxb + i] < NB, "block id out of range");
  }
  // DVC: D / 16 where it is known at compile time (head_dim 64 or 128: the accumulators of a query head
  // then live in registers), 0 otherwise
  auto run = [&](auto kind_c, auto dv_c) {
  constexpr KV KIND = decltype(kind_c)::value;
  constexpr int DVC = decltype(dv_c)::value;
  const int64_t DV = DVC ? DVC : D / 16;
  using R = Row<KIND>;
  constexpr int T = 16;  // tokens per block of V
  at::parallel_for(0, B * Hkv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores, vbuf(KIND == KV::F32 ? 0 : T * D), invs(G);
    std::vector<v16f> acc(G * DV);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hkv, h = p % Hkv, ctx = lens[b];
      const int64_t start = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t L = ctx - start, Lp = (L + 15) / 16 * 16;  // Lp: L padded to whole vectors
      scores.resize(G * Lp);
      auto row = [&](const uint8_t* base, int64_t t) {
        const int64_t blk = bt[b * maxb + t / bs];
        return R{base + ((blk * bs + t % bs) * Hkv + h) * row_bytes, D};
      };
      // scores = q . k * scale, per query head of the group: 16 tokens at a time, their 16 partial-sum
      // vectors folded into one vector of 16 scores (reduce16) instead of 16 horizontal sums
      int64_t t = 0;
      for (; t + 16 <= L; t += 16) {
        R ks[16];
        float kscale[16];
        for (int j = 0; j < 16; ++j) { ks[j] = row(kb, start + t + j); kscale[j] = ks[j].scale() * scale; }
        // the cache rows of a block are Hkv rows apart and blocks lie anywhere: fetch the next 16 K rows and
        // these tokens' V rows (read by the output pass) while this block computes
        for (int j = 0; j < 16; ++j) {
          const uint8_t* vr = row(vb, start + t + j).p;
          for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(vr + o, 0, 3);
          if (t + 16 + j < L) {
            const uint8_t* kr = row(kb, start + t + 16 + j).p;
            for (int64_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(kr + o, 0, 3);
          }
        }
        const v16f sv = load<v16f>(kscale);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qp + (b * H + h * G + g) * D;
          v16f s[16];
          for (int j = 0; j < 16; ++j) s[j] = v16f{};
          for (int64_t d = 0; d < DV * 16; d += 16) {
            const v16f qv = load<v16f>(qg + d);
            for (int j = 0; j < 16; ++j) s[j] += qv * ks[j].at(d);
          }
          store(scores.data() + g * Lp + t, reduce16(s) * sv);
        }
      }
      for (; t < L; ++t) {
        R k = row(kb, start + t);
        const float ksc = k.scale() * scale;
        for (int64_t g = 0; g < G; ++g) {
          v16f a{};
          for (int64_t d = 0; d < DV * 16; d += 16) a += load<v16f>(qp + (b * H + h * G + g) * D + d) * k.at(d);
          scores[g * Lp + t] = hsum(a) * ksc;
        }
      }
      // softmax numerators per query head, 16 at a time (the padding past L becomes exp(-inf) = 0); the
      // division by their sum is applied to the output
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * Lp;
        for (int64_t t = L; t < Lp; ++t) sc[t] = -std::numeric_limits<float>::infinity();
        v16f mv = splat<v16f>(-std::numeric_limits<float>::infinity());
        for (int64_t t = 0; t < Lp; t += 16) mv = vmax(mv, load<v16f>(sc + t));
        float mvs[16];
        store(mvs, mv);
        float mx = mvs[0];
        for (int j = 1; j < 16; ++j) mx = std::max(mx, mvs[j]);
        v16f sum{};
        for (int64_t t = 0; t < Lp; t += 16) {
          const v16f e = exp16(load<v16f>(sc + t) - mx);
          store(sc + t, e);
          sum += e;
        }
        invs[g] = 1.f / hsum(sum);
      }
      // out = sum_t p_t v_t / sum_t p_t, V in blocks of T tokens (as float rows: the cache's own rows for
      // float32, else converted and scaled once into vbuf), each block applied to every query head
      std::fill(acc.begin(), acc.end(), v16f{});
      for (int64_t t0 = 0; t0 < L; t0 += T) {
        const int nt = (int)std::min<int64_t>(T, L - t0);
        const float* vr[T];
        for (int j = 0; j < nt; ++j) {
          const R v = row(vb, start + t0 + j);
          if constexpr (KIND == KV::F32) {
            vr[j] = reinterpret_cast<const float*>(v.p);
          } else {
            const float vs = v.scale();
            for (int64_t d = 0; d < DV * 16; d += 16) store(vbuf.data() + j * D + d, v.at(d) * vs);
            vr[j] = vbuf.data() + j * D;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = scores.data() + g * Lp + t0;
          v16f* ag = acc.data() + g * DV;
          if constexpr (DVC > 0) {
            v16f a[DVC];
            for (int dv = 0; dv < DVC; ++dv) a[dv] = ag[dv];
            for (int j = 0; j < nt; ++j) {
              const v16f pj = splat<v16f>(pg[j]);
              for (int dv = 0; dv < DVC; ++dv) a[dv] += pj * load<v16f>(vr[j] + 16 * dv);
            }
            for (int dv = 0; dv < DVC; ++dv) ag[dv] = a[dv];
          } else {
            for (int j = 0; j < nt; ++j) {
              const v16f pj = splat<v16f>(pg[j]);
              for (int64_t dv = 0; dv < DV; ++dv) ag[dv] += pj * load<v16f>(vr[j] + 16 * dv);
            }
          }
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t dv = 0; dv < DV; ++dv) store(op + (b * H + h * G + g) * D + 16 * dv, acc[g * DV + dv] * invs[g]);
    }
  });
  };
  auto by_d = [&](auto kind_c) {
    if (D == 64) run(kind_c, std::integral_constant<int, 4>{});
    else if (D == 128) run(kind_c, std::integral_constant<int, 8>{});
    else run(kind_c, std::integral_constant<int, 0>{});
  };
  switch (kind) {
    case KV::F32: by_d(std::integral_constant<KV, KV::F32>{}); break;
    case KV::BF16: by_d(std::integral_constant<KV, KV::BF16>{}); break;
    default: by_d(std::integral_constant<KV, KV::I8>{}); break;
  }
  return out;
}

}  // namespace pdserve
