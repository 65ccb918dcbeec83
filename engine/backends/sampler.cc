#include "engine/backends/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

// The 8-lane helpers are always inlined: no vector crosses a call boundary.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#include "kernels/cpu/vmath.h"
#include "kernels/philox.h"

namespace relgen {
namespace {


// Every pass over a row runs over blocks of kChunk ids; a block's mass is summed in eight lanes
// (i mod 8), so the sums are fixed by the row alone and cost an eighth of a serial walk.
constexpr int kChunk = 256;

inline uint32_t Key(float w) {  // w >= 0: the bits order as the values do (-0 and a NaN's sign dropped)
  uint32_t k;
  std::memcpy(&k, &w, sizeof(k));
  return k & 0x7fffffffu;
}

// The candidates kept so far: id i stays iff key_i > bits, or key_i == bits and i <= last (the
// order is w descending, lower id first).
struct Cut {
  uint32_t bits = 0;
  int32_t last = std::numeric_limits<int32_t>::max();
  bool Keeps(uint32_t key, int32_t i) const { return key > bits || (key == bits && i <= last); }
};

typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef uint32_t U8 __attribute__((vector_size(32)));

// The row passes, on eight float lanes whatever the machine: compiled twice (the baseline and
// AVX2 without FMA), the same arithmetic in the same order, so the bits match across machines.
struct RowOps {
  // Largest of x[0..n).
  __attribute__((always_inline)) static float Max(const float* x, int n) {
    V8 m = {};
    m -= INFINITY;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      V8 v;
      std::memcpy(&v, x + i, sizeof(v));
      m = v > m ? v : m;
    }
    float r = -INFINITY;
    for (int l = 0; l < 8; ++l) r = std::max(r, m[l]);
    for (; i < n; ++i) r = std::max(r, x[i]);
    return r;
  }
  // w = exp((x - mx) * scale); chunk[c] = the sum of block c's w (lanes in float, then pairwise in double).
  __attribute__((always_inline)) static void Weights(const float* x, int n, float mx, float scale, float* w,
                                                     double* chunk) {
    for (int c = 0; c * kChunk < n; ++c) {
      const int end = std::min(n, (c + 1) * kChunk);
      V8 acc = {};
      for (int i = c * kChunk; i < end; i += 8) {
        V8 t;
        if (i + 8 <= end) {
          std::memcpy(&t, x + i, sizeof(t));
        } else {
          for (int l = 0; l < 8; ++l) t[l] = i + l < end ? x[i + l] : -INFINITY;  // exp: 0
        }
        t = cpu::vmath::ExpN<V8, I8>((t - mx) * scale);
        if (i + 8 <= end) {
          std::memcpy(w + i, &t, sizeof(t));
        } else {
          for (int l = 0; i + l < end; ++l) w[i + l] = t[l];
        }
        acc += t;
      }
      chunk[c] = Lanes(acc);
    }
  }
  // chunk[c] = the sum of block c's w over the ids `keeps(bits, last)` keeps.
  __attribute__((always_inline)) static void KeptMass(const float* w, int n, uint32_t bits, int32_t last,
                                                      double* chunk) {
    const I8 step = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int c = 0; c * kChunk < n; ++c) {
      const int end = std::min(n, (c + 1) * kChunk);
      V8 acc = {};
      for (int i = c * kChunk; i < end; i += 8) {
        V8 t = {};
        if (i + 8 <= end) {
          std::memcpy(&t, w + i, sizeof(t));
        } else {
          for (int l = 0; i + l < end; ++l) t[l] = w[i + l];
        }
        const U8 key = reinterpret_cast<U8>(t) & 0x7fffffffu;
        const I8 id = step + i;
        const I8 keep = (key > bits) | ((key == bits) & (id <= last));
        acc += keep ? t : V8{};
      }
      chunk[c] = Lanes(acc);
    }
  }
  __attribute__((always_inline)) static double Lanes(V8 a) {
    return ((static_cast<double>(a[0]) + a[1]) + (static_cast<double>(a[2]) + a[3])) +
           ((static_cast<double>(a[4]) + a[5]) + (static_cast<double>(a[6]) + a[7]));
  }
};

float MaxBase(const float* x, int n) { return RowOps::Max(x, n); }
void WeightsBase(const float* x, int n, float mx, float scale, float* w, double* chunk) {
  RowOps::Weights(x, n, mx, scale, w, chunk);
}
void KeptMassBase(const float* w, int n, uint32_t bits, int32_t last, double* chunk) {
  RowOps::KeptMass(w, n, bits, last, chunk);
}
#if defined(__x86_64__)
__attribute__((target("avx2"))) float MaxAvx2(const float* x, int n) { return RowOps::Max(x, n); }
__attribute__((target("avx2"))) void WeightsAvx2(const float* x, int n, float mx, float scale, float* w,
                                                 double* chunk) {
  RowOps::Weights(x, n, mx, scale, w, chunk);
}
__attribute__((target("avx2"))) void KeptMassAvx2(const float* w, int n, uint32_t bits, int32_t last,
                                                  double* chunk) {
  RowOps::KeptMass(w, n, bits, last, chunk);
}
const bool kAvx2 = __builtin_cpu_supports("avx2");
#else
const bool kAvx2 = false;
#define MaxAvx2 MaxBase
#define WeightsAvx2 WeightsBase
#define KeptMassAvx2 KeptMassBase
#endif

float MaxOf(const float* x, int n) { return kAvx2 ? MaxAvx2(x, n) : MaxBase(x, n); }
void Weights(const float* x, int n, float mx, float scale, float* w, double* chunk) {
  kAvx2 ? WeightsAvx2(x, n, mx, scale, w, chunk) : WeightsBase(x, n, mx, scale, w, chunk);
}
void KeptMass(const float* w, int n, const Cut& cut, double* chunk) {
  kAvx2 ? KeptMassAvx2(w, n, cut.bits, cut.last, chunk) : KeptMassBase(w, n, cut.bits, cut.last, chunk);
}

int32_t Argmax(absl::Span<const float> x) {
  const float m = MaxOf(x.data(), static_cast<int>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == m) return static_cast<int32_t>(i);
  }
  // NaN everywhere: nothing compares; the first id, as a float argmax would.
  return 0;
}

// Steps 1-4 of the definitions, on a copy when any applies. *none_left: every token banned.
absl::Span<const float> Processed(absl::Span<const float> logits, const SamplingParams& p,
                                  absl::Span<const int32_t> history, int index, SamplerScratch* s, bool* none_left) {
  *none_left = false;
  const bool penalty = p.repetition_penalty != 1.0f && !history.empty();
  if (!penalty && !p.ProcessesRow(index)) return logits;
  const int v = static_cast<int>(logits.size());
  s->x.assign(logits.begin(), logits.end());
  auto valid = [&](int32_t t) { return t >= 0 && t < v; };
  if (penalty) {
    s->ids.assign(history.begin(), history.end());
    std::sort(s->ids.begin(), s->ids.end());
    s->ids.erase(std::unique(s->ids.begin(), s->ids.end()), s->ids.end());
    for (int32_t t : s->ids) {
      if (!valid(t)) continue;
      float& l = s->x[t];
      l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    const size_t out = std::min(history.size(), static_cast<size_t>(std::max(index, 0)));
    s->ids.assign(history.end() - out, history.end());
    std::sort(s->ids.begin(), s->ids.end());
    for (size_t i = 0; i < s->ids.size();) {
      size_t j = i;
      while (j < s->ids.size() && s->ids[j] == s->ids[i]) ++j;
      if (valid(s->ids[i])) {
        float& l = s->x[s->ids[i]];
        const float f = p.frequency_penalty * static_cast<float>(j - i);
        l = l - f;
        l = l - p.presence_penalty;
      }
      i = j;
    }
  }
  for (const auto& [t, bias] : p.logit_bias) {
    if (valid(t)) s->x[t] = s->x[t] + bias;
  }
  if (!p.allowed_token_ids.empty()) {
    size_t k = 0;
    for (int i = 0; i < v; ++i) {
      while (k < p.allowed_token_ids.size() && p.allowed_token_ids[k] < i) ++k;
      if (k == p.allowed_token_ids.size() || p.allowed_token_ids[k] != i) s->x[i] = -INFINITY;
    }
  }
  for (const std::vector<int32_t>& w : p.bad_words) {
    const size_t prefix = w.size() - 1;
    if (prefix > history.size() || !valid(w.back())) continue;
    if (std::equal(w.begin(), w.end() - 1, history.end() - prefix)) s->x[w.back()] = -INFINITY;
  }
  if (index < p.min_tokens) {
    for (int32_t t : p.min_tokens_banned) {
      if (valid(t)) s->x[t] = -INFINITY;
    }
  }
  const size_t ngram = static_cast<size_t>(std::max(p.no_repeat_ngram_size, 0));
  if (ngram > 0 && history.size() >= ngram) {
    const auto suffix = history.end() - (ngram - 1);
    for (size_t i = 0; i + ngram <= history.size(); ++i) {
      const int32_t t = history[i + ngram - 1];
      if (valid(t) && std::equal(suffix, history.end(), history.begin() + i)) s->x[t] = -INFINITY;
    }
  }
  *none_left = MaxOf(s->x.data(), v) == -INFINITY;
  return s->x;
}

// The cut after the first candidate, in order, at which the running total (of w when `by_mass`,
// else of ones) reaches `target`, among those `prev` keeps; `prev` when the total never does.
// A radix selection on the bits of w: 11, 10 and 10 bits, then the tied ids in id order.
Cut FindCut(const float* w, int v, const Cut& prev, bool by_mass, double target, SamplerScratch* s) {
  std::vector<double>& bins = s->mass;
  std::vector<int32_t>& ids = s->ids;
  auto val = [&](int32_t i) { return by_mass ? static_cast<double>(w[i]) : 1.0; };
  // Walks bins from the top; returns the bin where the total reaches target (acc: the total before it).
  auto walk = [&](int nbins, double* acc) {
    for (int b = nbins - 1; b >= 0; --b) {
      if (*acc + bins[b] >= target) return b;
      *acc += bins[b];
    }
    return -1;
  };
  double acc = 0;
  bins.assign(2048, 0.0);
  for (int i = 0; i < v; ++i) {
    const uint32_t k = Key(w[i]);
    if (prev.Keeps(k, i)) bins[k >> 20] += val(i);
  }
  const int b1 = walk(2048, &acc);
  if (b1 < 0) return prev;
  ids.clear();
  for (int i = 0; i < v; ++i) {
    const uint32_t k = Key(w[i]);
    if ((k >> 20) == static_cast<uint32_t>(b1) && prev.Keeps(k, i)) ids.push_back(i);
  }
  bins.assign(1024, 0.0);
  for (int32_t i : ids) bins[(Key(w[i]) >> 10) & 1023] += val(i);
  const int b2 = walk(1024, &acc);
  if (b2 < 0) return prev;
  const uint32_t high = static_cast<uint32_t>(b1) << 20 | static_cast<uint32_t>(b2) << 10;
  bins.assign(1024, 0.0);
  for (int32_t i : ids) {
    if ((Key(w[i]) & ~1023u) == high) bins[Key(w[i]) & 1023] += val(i);
  }
  const int b3 = walk(1024, &acc);
  if (b3 < 0) return prev;
  const uint32_t bits = high | static_cast<uint32_t>(b3);
  for (int32_t i : ids) {
    if (Key(w[i]) != bits) continue;
    acc += val(i);
    if (acc >= target) return Cut{bits, i};
  }
  return prev;
}

}  // namespace

double SampleUniform(uint64_t seed, int index) { return philox::Uniform(seed, static_cast<uint64_t>(index)); }

int32_t DrawToken(absl::Span<const float> logits, const SamplingParams& p, absl::Span<const int32_t> history,
                  double u, SamplerScratch* s, int index) {
  bool none_left = false;
  const absl::Span<const float> x = Processed(logits, p, history, index, s, &none_left);
  if (none_left) return -1;
  const int v = static_cast<int>(x.size());
  const float mx = MaxOf(x.data(), v);
  const int chunks = (v + kChunk - 1) / kChunk;
  s->w.resize(v);
  s->chunk.resize(chunks);
  Weights(x.data(), v, mx, 1.0f / p.temperature, s->w.data(), s->chunk.data());
  const float* w = s->w.data();
  auto total_of = [&] {
    double total = 0;
    for (int c = 0; c < chunks; ++c) total += s->chunk[c];
    return total;
  };

  Cut cut;
  bool all = true;
  if (p.top_k > 0 && p.top_k < v) {
    cut = FindCut(w, v, cut, /*by_mass=*/false, p.top_k, s);
    all = false;
    KeptMass(w, v, cut, s->chunk.data());
  }
  double total = total_of();
  if (p.top_p < 1.0f) {
    const Cut by_p = FindCut(w, v, cut, /*by_mass=*/true, static_cast<double>(p.top_p) * total, s);
    if (by_p.bits != cut.bits || by_p.last != cut.last) {
      cut = by_p;
      all = false;
      KeptMass(w, v, cut, s->chunk.data());
      total = total_of();
    }
  }
  if (p.min_p > 0.0f && Key(p.min_p) > cut.bits) {
    // Keeps w >= min_p: a suffix cut of the same order (the largest w is 1, so one token stays).
    cut = Cut{Key(p.min_p), std::numeric_limits<int32_t>::max()};
    all = false;
    KeptMass(w, v, cut, s->chunk.data());
    total = total_of();
  }
  // The draw walks the kept ids in id order, a block at a time.
  const double target = u * total;
  double cum = 0;
  int32_t last_kept = -1;
  for (int c = 0; c < chunks; ++c) {
    if (cum + s->chunk[c] <= target && c + 1 < chunks) {
      cum += s->chunk[c];
      continue;
    }
    for (int i = c * kChunk; i < std::min(v, (c + 1) * kChunk); ++i) {
      if (!all && !cut.Keeps(Key(w[i]), i)) continue;
      last_kept = i;
      cum += w[i];
      if (cum > target) return i;
    }
    // Rounding left the target just past this block: the next kept id takes it.
  }
  if (last_kept >= 0) return last_kept;
  for (int i = v - 1; i >= 0; --i) {  // every weight underflowed: the largest logit, as greedy
    if (all || cut.Keeps(Key(w[i]), i)) last_kept = i;
  }
  return std::max(last_kept, 0);
}

namespace {

// log(sum exp(logits)).
double LogNormaliser(absl::Span<const float> logits) {
  const int v = static_cast<int>(logits.size());
  const float mx = MaxOf(logits.data(), v);
  thread_local std::vector<float> w;
  thread_local std::vector<double> chunk;
  w.resize(v);
  chunk.resize((v + kChunk - 1) / kChunk);
  Weights(logits.data(), v, mx, 1.0f, w.data(), chunk.data());
  double z = 0;
  for (double c : chunk) z += c;
  return mx + std::log(z);
}

// The n largest of x, best first (ties: lower id first), as x_i - log_z.
void TopOf(absl::Span<const float> x, int n, double log_z, std::vector<TokenLogprob>* top) {
  const int v = static_cast<int>(x.size());
  n = std::min(n, v);
  if (n <= 0) return;
  // The n best so far, best first; most ids fail the first comparison.
  std::vector<int32_t> best;
  best.reserve(n + 1);
  auto better = [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  float worst = -INFINITY;
  for (int32_t i = 0; i < v; ++i) {
    if (x[i] < worst) continue;
    if (static_cast<int>(best.size()) == n && !better(i, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), i, better), i);
    if (static_cast<int>(best.size()) > n) best.pop_back();
    if (static_cast<int>(best.size()) == n) worst = x[best.back()];
  }
  for (int32_t i : best) top->push_back({i, static_cast<float>(x[i] - log_z)});
}

}  // namespace

SampleResult TokenLogprobs(absl::Span<const float> logits, int32_t token, int top_n) {
  const double log_z = LogNormaliser(logits);
  SampleResult out;
  out.token = token;
  out.logprob = static_cast<float>(logits[token] - log_z);
  TopOf(logits, top_n, log_z, &out.top);
  return out;
}

SampleResult BeamCandidates(absl::Span<const float> logits, const SamplingParams& p,
                            absl::Span<const int32_t> history, int index, int n, SamplerScratch* scratch) {
  const double log_z = LogNormaliser(logits);
  bool none_left = false;
  const absl::Span<const float> x = Processed(logits, p, history, index, scratch, &none_left);
  SampleResult out;
  out.token = -1;
  if (none_left) return out;
  TopOf(x, n, log_z, &out.top);
  // Banned tokens (-inf) are never candidates.
  while (!out.top.empty() && x[out.top.back().token] == -INFINITY) out.top.pop_back();
  if (!out.top.empty()) {
    out.token = out.top.front().token;
    out.logprob = out.top.front().logprob;
  }
  return out;
}

SampleResult Sample(absl::Span<const float> logits, const SamplingParams& p, absl::Span<const int32_t> history,
                    int index, SamplerScratch* scratch) {
  int32_t token;
  if (p.temperature == 0.0f) {
    bool none_left = false;
    const absl::Span<const float> x = Processed(logits, p, history, index, scratch, &none_left);
    token = none_left ? -1 : Argmax(x);
  } else {
    token = DrawToken(logits, p, history, SampleUniform(p.seed, index), scratch, index);
  }
  if (token < 0) {
    SampleResult none;
    none.token = -1;
    return none;
  }
  if (p.logprobs >= 0) return TokenLogprobs(logits, token, p.logprobs);
  SampleResult out;
  out.token = token;
  return out;
}

void AnswerQueries(const float* logits, int vocab, absl::Span<const RowQuery> queries,
                   std::vector<SampleResult>* results, const ParallelFor& parallel_for) {
  results->assign(queries.size(), SampleResult());
  auto run = [&](int begin, int end) {
    thread_local SamplerScratch scratch;
    for (int q = begin; q < end; ++q) {
      const RowQuery& r = queries[q];
      const absl::Span<const float> row(logits + static_cast<size_t>(r.row) * vocab, vocab);
      if (r.params == nullptr) {
        (*results)[q] = TokenLogprobs(row, r.token, r.top_n);
      } else if (r.beam > 0) {
        (*results)[q] = BeamCandidates(row, *r.params, r.history, r.index, r.beam, &scratch);
      } else {
        (*results)[q] = Sample(row, *r.params, r.history, r.index, &scratch);
      }
    }
  };
  const int n = static_cast<int>(queries.size());
  if (parallel_for && n > 1) {
    parallel_for(n, run);
  } else {
    run(0, n);
  }
}

}  // namespace relgen
