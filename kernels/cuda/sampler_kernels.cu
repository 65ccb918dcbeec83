#include "kernels/cuda/sampler_kernels.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "kernels/cuda/launch.h"
#include "kernels/philox.h"

namespace relgen::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kQuantum = 1099511627776.0f;  // 2^40

struct Pair {  // a value and its id; ordered by value descending, lower id first
  float v;
  int32_t id;
};

__device__ __forceinline__ bool Before(Pair a, Pair b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }

__device__ __forceinline__ uint32_t KeyOf(float w) {
  uint32_t k;
  memcpy(&k, &w, sizeof(k));
  return k & 0x7fffffffu;
}

// Block-wide reductions through shared memory (every thread gets the result).
template <typename T, typename F>
__device__ T Reduce(T v, T* red, F combine) {
  red[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) red[threadIdx.x] = combine(red[threadIdx.x], red[threadIdx.x + s]);
    __syncthreads();
  }
  const T r = red[0];
  __syncthreads();
  return r;
}

struct Smem {
  unsigned long long u64[kThreads];
  double f64[kThreads];
  Pair pair[kThreads];
};

__global__ void __launch_bounds__(kThreads, 4) AnswerRowsKernel(float* logits, int vocab, const DeviceQuery* queries, const int32_t* history,
                                 float* history_raw, const double* u_override, DeviceAnswer* answers) {
  __shared__ Smem sm;
  const DeviceQuery q = queries[blockIdx.x];
  float* row = logits + static_cast<int64_t>(q.row) * vocab;
  DeviceAnswer* out = answers + blockIdx.x;
  const int tid = threadIdx.x;
  auto sum_u64 = [&](unsigned long long v) {
    return Reduce(v, sm.u64, [](unsigned long long a, unsigned long long b) { return a + b; });
  };
  auto best = [&](Pair p) { return Reduce(p, sm.pair, [](Pair a, Pair b) { return Before(b, a) ? b : a; }); };
  const Pair none{-INFINITY, 0x7fffffff};

  // Log-probabilities of the raw logits, before anything changes the row.
  double log_z = 0;
  const bool beam = q.draw == 2;  // candidates from the processed row, after the processing below
  const bool want_lp = !q.draw || q.top_n >= 0;
  if (want_lp) {
    Pair m = none;
    for (int i = tid; i < vocab; i += kThreads) m = Before(Pair{row[i], i}, m) ? Pair{row[i], i} : m;
    const float mx = best(m).v;
    double z = 0;
    for (int i = tid; i < vocab; i += kThreads) z += expf(row[i] - mx);
    z = Reduce(z, sm.f64, [](double a, double b) { return a + b; });
    log_z = mx + log(z);
    const int n = q.top_n < 0 || beam ? 0 : q.top_n > kMaxAnswerTop ? kMaxAnswerTop : q.top_n;
    Pair last{INFINITY, -1};
    for (int k = 0; k < n && k < vocab; ++k) {
      Pair c = none;
      for (int i = tid; i < vocab; i += kThreads) {
        const Pair p{row[i], i};
        if (Before(last, p) && Before(p, c)) c = p;
      }
      last = best(c);
      if (tid == 0) {
        out->top_token[k] = last.id;
        out->top_logprob[k] = static_cast<float>(last.v - log_z);
      }
    }
    if (tid == 0 && !beam) out->num_top = n < vocab ? n : vocab;
  }
  if (!q.draw) {
    if (tid == 0) {
      out->token = q.token;
      out->logprob = static_cast<float>(row[q.token] - log_z);
    }
    return;
  }

  // Processing in place: the raw values of the history's tokens and the bias's are kept first,
  // and every write to a token of the row is made by one thread, so none races.
  const int32_t* hist = history + q.history_offset;
  float* raw = history_raw + q.history_offset;
  const int32_t* ctl = q.controls_offset >= 0 ? history + q.controls_offset : nullptr;
  float* ctl_raw = history_raw + q.controls_offset;
  const int n_bias = ctl != nullptr ? ctl[0] : 0;
  auto valid = [&](int32_t t) { return t >= 0 && t < vocab; };
  // Ids outside the vocabulary are skipped, as the host sampler skips them.
  for (int j = tid; j < q.history_len; j += kThreads) raw[j] = valid(hist[j]) ? row[hist[j]] : 0.0f;
  for (int k = tid; k < n_bias; k += kThreads) ctl_raw[1 + 2 * k] = row[ctl[1 + 2 * k]];
  __syncthreads();
  if (q.repetition_penalty != 1.0f) {
    for (int j = 0; j < q.history_len; ++j) {
      const int32_t t = hist[j];
      if (!valid(t) || t % kThreads != tid) continue;
      const float l = raw[j];
      row[t] = l > 0 ? l / q.repetition_penalty : l * q.repetition_penalty;
    }
    __syncthreads();
  }
  if (q.presence_penalty != 0.0f || q.frequency_penalty != 0.0f) {
    // The output's distinct tokens, each by the thread of its first occurrence.
    const int from = q.history_len > q.index ? q.history_len - q.index : 0;
    for (int j = from + tid; j < q.history_len; j += kThreads) {
      const int32_t t = hist[j];
      bool first = valid(t);
      for (int k = from; first && k < j; ++k) first = hist[k] != t;
      if (!first) continue;
      int c = 0;
      for (int k = j; k < q.history_len; ++k) c += hist[k] == t ? 1 : 0;
      row[t] = __fsub_rn(__fsub_rn(row[t], __fmul_rn(q.frequency_penalty, static_cast<float>(c))), q.presence_penalty);
    }
    __syncthreads();
  }
  if (ctl != nullptr) {
    for (int k = tid; k < n_bias; k += kThreads) {
      float b;
      memcpy(&b, &ctl[2 + 2 * k], sizeof(b));
      row[ctl[1 + 2 * k]] = __fadd_rn(row[ctl[1 + 2 * k]], b);
    }
    __syncthreads();
    const int32_t* allowed = ctl + 1 + 2 * n_bias;
    const int n_allowed = allowed[0];
    if (n_allowed > 0) {
      for (int i = tid; i < vocab; i += kThreads) {
        int lo = 0, hi = n_allowed;  // first allowed id >= i
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (allowed[1 + mid] < i) lo = mid + 1; else hi = mid;
        }
        if (lo == n_allowed || allowed[1 + lo] != i) row[i] = -INFINITY;
      }
    }
    __syncthreads();
    if (tid == 0) {
      const int32_t* banned = allowed + 1 + n_allowed;
      for (int k = 0; k < banned[0]; ++k) {
        if (valid(banned[1 + k])) row[banned[1 + k]] = -INFINITY;
      }
      const int32_t* words = banned + 1 + banned[0];
      const int n_words = words[0];
      const int32_t* w = words + 1;
      for (int k = 0; k < n_words; ++k) {
        const int len = w[0];
        const int32_t* tok = w + 1;
        bool match = len - 1 <= q.history_len && valid(tok[len - 1]);
        for (int m = 0; match && m < len - 1; ++m) match = hist[q.history_len - (len - 1) + m] == tok[m];
        if (match) row[tok[len - 1]] = -INFINITY;
        w += 1 + len;
      }
    }
    __syncthreads();
  }
  if (q.no_repeat_ngram_size > 0) {
    // One thread: a pass over the history's n-grams (length x n compares; the other bans are as cheap).
    const int n = q.no_repeat_ngram_size;
    if (tid == 0 && q.history_len >= n) {
      for (int i = 0; i + n <= q.history_len; ++i) {
        bool match = valid(hist[i + n - 1]);
        for (int m = 0; match && m < n - 1; ++m) match = hist[i + m] == hist[q.history_len - (n - 1) + m];
        if (match) row[hist[i + n - 1]] = -INFINITY;
      }
    }
    __syncthreads();
  }
  if (beam) {
    // The best unbanned tokens of the processed row, as log_softmax(raw) processed.
    const int n = q.top_n > kMaxAnswerTop ? kMaxAnswerTop : q.top_n;
    Pair last{INFINITY, -1};
    int found = 0;
    for (; found < n && found < vocab; ++found) {
      Pair c = none;
      for (int i = tid; i < vocab; i += kThreads) {
        const Pair p{row[i], i};
        if (Before(last, p) && Before(p, c)) c = p;
      }
      c = best(c);
      if (c.v == -INFINITY) break;
      last = c;
      if (tid == 0) {
        out->top_token[found] = c.id;
        out->top_logprob[found] = static_cast<float>(c.v - log_z);
      }
    }
    if (tid == 0) {
      out->num_top = found;
      out->token = found > 0 ? out->top_token[0] : -1;
      out->logprob = found > 0 ? out->top_logprob[0] : 0.0f;
    }
    return;
  }
  auto raw_of = [&](int32_t t) {
    for (int j = 0; j < q.history_len; ++j) {
      if (hist[j] == t) return raw[j];
    }
    for (int k = 0; k < n_bias; ++k) {
      if (ctl[1 + 2 * k] == t) return ctl_raw[1 + 2 * k];
    }
    return row[t];
  };

  int32_t token;
  Pair top = none;
  for (int i = tid; i < vocab; i += kThreads) top = Before(Pair{row[i], i}, top) ? Pair{row[i], i} : top;
  top = best(top);
  if (top.v == -INFINITY) {
    token = -1;  // every token banned
  } else if (q.temperature == 0.0f) {
    token = top.id;
  } else {
    const float mx = top.v;
    const float inv_t = 1.0f / q.temperature;
    auto w_of = [&](int i) { return expf((row[i] - mx) * inv_t); };
    auto q_of = [&](float w) { return static_cast<unsigned long long>(w * kQuantum); };
    // Kept: key > bk or (key == bk and id <= ik), for the top-k cut and the top-p cut.
    uint32_t bk = 0, bp = 0, bm = 0;  // bm: min_p's, keeps key >= bm
    int32_t ik = 0x7fffffff, ip = 0x7fffffff;
    auto kept = [&](uint32_t key, int i) {
      return (key > bk || (key == bk && i <= ik)) && (key > bp || (key == bp && i <= ip)) && key >= bm;
    };
    // sum over ids <= last of `f(i, key, w)` (counts or masses).
    auto total = [&](int last, auto f) {
      unsigned long long s = 0;
      for (int i = tid; i <= last; i += kThreads) {
        const float w = w_of(i);
        s += f(i, KeyOf(w), w);
      }
      return sum_u64(s);
    };
    // The cut at which the running total, in (w descending, id ascending) order, first reaches
    // `target` among the kept: the largest key b whose at-or-above total reaches it, then the
    // smallest tied id that does.
    auto cut = [&](bool by_mass, unsigned long long target, uint32_t* b_out, int32_t* i_out) {
      auto val = [&](float w) { return by_mass ? q_of(w) : 1ull; };
      uint32_t lo = 0, hi = 0x7fffffffu;
      while (lo < hi) {
        const uint32_t mid = lo + (hi - lo + 1) / 2;
        const unsigned long long s =
            total(vocab - 1, [&](int i, uint32_t key, float w) { return key >= mid && kept(key, i) ? val(w) : 0ull; });
        if (s >= target) lo = mid; else hi = mid - 1;
      }
      const uint32_t b = lo;
      const unsigned long long above =
          total(vocab - 1, [&](int i, uint32_t key, float w) { return key > b && kept(key, i) ? val(w) : 0ull; });
      int32_t ilo = 0, ihi = vocab - 1;
      while (ilo < ihi) {
        const int32_t mid = ilo + (ihi - ilo) / 2;
        const unsigned long long s =
            total(mid, [&](int i, uint32_t key, float w) { return key == b && kept(key, i) ? val(w) : 0ull; });
        if (above + s >= target) ihi = mid; else ilo = mid + 1;
      }
      *b_out = b;
      *i_out = ilo;
    };
    if (q.top_k > 0 && q.top_k < vocab) cut(false, static_cast<unsigned long long>(q.top_k), &bk, &ik);
    if (q.top_p < 1.0f) {
      const unsigned long long mass =
          total(vocab - 1, [&](int i, uint32_t key, float w) { return kept(key, i) ? q_of(w) : 0ull; });
      const unsigned long long target =
          static_cast<unsigned long long>(ceil(static_cast<double>(q.top_p) * static_cast<double>(mass)));
      if (target < mass) cut(true, target > 0 ? target : 1ull, &bp, &ip);
    }
    if (q.min_p > 0.0f) bm = KeyOf(q.min_p);
    const unsigned long long mass =
        total(vocab - 1, [&](int i, uint32_t key, float w) { return kept(key, i) ? q_of(w) : 0ull; });
    const double u = u_override != nullptr ? u_override[blockIdx.x]
                                           : philox::Uniform(q.seed, static_cast<uint64_t>(q.index));
    unsigned long long target = static_cast<unsigned long long>(u * static_cast<double>(mass));
    if (target >= mass) target = mass - 1;
    int32_t lo = 0, hi = vocab - 1;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo) / 2;
      const unsigned long long s =
          total(mid, [&](int i, uint32_t key, float w) { return kept(key, i) ? q_of(w) : 0ull; });
      if (s > target) hi = mid; else lo = mid + 1;
    }
    token = lo;
  }
  if (tid == 0) {
    out->token = token;
    out->logprob = want_lp && token >= 0 ? static_cast<float>(raw_of(token) - log_z) : 0.0f;
    if (!want_lp || token < 0) out->num_top = 0;
  }
}

__global__ void __launch_bounds__(kThreads) FeedTokensKernel(const DeviceAnswer* answers, const int32_t* feeds, int n,
                                                            int32_t* dst) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i < n) dst[feeds[2 * i]] = max(answers[feeds[2 * i + 1]].token, 0);  // -1 ends its sequence: moot
}

}  // namespace

cudaError_t FeedTokens(const DeviceAnswer* answers, const int32_t* feeds, int n, int32_t* dst, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(FeedTokensKernel, (n + kThreads - 1) / kThreads, kThreads, 0, stream)(answers, feeds, n, dst);
  return cudaGetLastError();
}

cudaError_t AnswerRows(float* logits, int vocab, const DeviceQuery* queries, int n, const int32_t* history,
                       float* history_raw, const double* u, DeviceAnswer* answers, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  RELGEN_LAUNCH(AnswerRowsKernel, n, kThreads, 0, stream)(logits, vocab, queries, history, history_raw, u, answers);
  return cudaGetLastError();
}

}  // namespace relgen::cuda
