#include "kernels/cpu/attention.h"

#include <cstring>

#include "kernels/bf16.h"

namespace relgen::cpu {

#define RELGEN_DECLARE_ATTENTION(isa)                                                              \
  namespace isa {                                                                                  \
  void AddSkewedRelativeLogits(const float* q, int ldq, int lq, int lk, const float* e, int m,     \
                               int hd, float mult, float* scores, float* scratch);                 \
  void AttentionPrefill(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,    \
                        const float* q, int start, int n, float* out, int head_begin,              \
                        int head_end);                                                             \
  void AttentionDecode(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,     \
                       const float* q, int pos, float* out, int head_begin, int head_end);         \
  void AttentionBidirectional(const AttentionDims& dims, const RelativeParams& rel,                \
                              const KvView& kv, const float* q, int n, float* out, int head_begin, \
                              int head_end);                                                       \
  }
RELGEN_DECLARE_ATTENTION(base)
RELGEN_DECLARE_ATTENTION(avx2)
RELGEN_DECLARE_ATTENTION(avx512)
#undef RELGEN_DECLARE_ATTENTION

namespace {

#define RELGEN_ATTENTION_KERNELS(isa)                                         \
  AttentionKernels {                                                          \
    isa::AttentionPrefill, isa::AttentionDecode, isa::AttentionBidirectional, \
        isa::AddSkewedRelativeLogits                                          \
  }

const AttentionKernels kBase = RELGEN_ATTENTION_KERNELS(base);
const AttentionKernels kAvx2 = RELGEN_ATTENTION_KERNELS(avx2);
const AttentionKernels kAvx512 = RELGEN_ATTENTION_KERNELS(avx512);

// Chosen once per process, so every row of a run takes the same arithmetic.
const AttentionKernels& Best() {
  static const AttentionKernels& k = AttentionKernelsFor(SupportedAttentionIsas().front());
  return k;
}

}  // namespace

std::vector<AttentionIsa> SupportedAttentionIsas() {
  // By hand, not target_clones: GCC's clone resolver runs before TSan's runtime is up.
  __builtin_cpu_init();
  std::vector<AttentionIsa> isas;
  if (__builtin_cpu_supports("avx512f")) isas.push_back(AttentionIsa::kAvx512);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    isas.push_back(AttentionIsa::kAvx2);
  isas.push_back(AttentionIsa::kBase);
  return isas;
}

const char* AttentionIsaName(AttentionIsa isa) {
  return isa == AttentionIsa::kAvx512 ? "avx512" : (isa == AttentionIsa::kAvx2 ? "avx2" : "base");
}

const AttentionKernels& AttentionKernelsFor(AttentionIsa isa) {
  return isa == AttentionIsa::kAvx512 ? kAvx512 : (isa == AttentionIsa::kAvx2 ? kAvx2 : kBase);
}

void WriteKv(const KvView& kv, const float* k, const float* v, int start, int n) {
  const int hd = kv.head_dim;
  const int width = kv.n_heads * hd;
  for (int t = 0; t < n; ++t) {
    for (int h = 0; h < kv.n_heads; ++h) {
      const int64_t src = static_cast<int64_t>(t) * width + h * hd;
      const int64_t dst = kv.RowOffset(h, start + t);
      if (kv.type == KvType::kBf16) {
        uint16_t* kd = static_cast<uint16_t*>(kv.k) + dst;
        uint16_t* vd = static_cast<uint16_t*>(kv.v) + dst;
        for (int d = 0; d < hd; ++d) {
          kd[d] = ToBf16(k[src + d]);
          vd[d] = ToBf16(v[src + d]);
        }
      } else {
        std::memcpy(static_cast<float*>(kv.k) + dst, k + src, hd * sizeof(float));
        std::memcpy(static_cast<float*>(kv.v) + dst, v + src, hd * sizeof(float));
      }
    }
  }
}

void AttentionPrefill(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                      const float* q, int start, int n, float* out, int head_begin, int head_end) {
  Best().prefill(dims, rel, kv, q, start, n, out, head_begin, head_end);
}

void AttentionDecode(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                     const float* q, int pos, float* out, int head_begin, int head_end) {
  Best().decode(dims, rel, kv, q, pos, out, head_begin, head_end);
}

void AttentionBidirectional(const AttentionDims& dims, const RelativeParams& rel, const KvView& kv,
                            const float* q, int n, float* out, int head_begin, int head_end) {
  Best().bidirectional(dims, rel, kv, q, n, out, head_begin, head_end);
}

void AddSkewedRelativeLogits(const float* q, int ldq, int lq, int lk, const float* e, int m, int hd,
                             float mult, float* scores, float* scratch) {
  Best().add_skewed(q, ldq, lq, lk, e, m, hd, mult, scores, scratch);
}

}  // namespace relgen::cpu
