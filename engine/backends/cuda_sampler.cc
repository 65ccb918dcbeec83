// Answering a step's kept rows on the device: the queries packed and uploaded, the answers collected.
#include "engine/backends/cuda_backend_impl.h"

#include <algorithm>
#include <cstring>

namespace relgen {
namespace cuda_backend {

namespace {

// A draw's controls in the device's layout (sampler_kernels.h, DeviceQuery::controls_offset): how
// many words, and writing them (returns the end).
bool BansNow(const SamplingParams& p, int index) { return index < p.min_tokens && !p.min_tokens_banned.empty(); }
int64_t ControlWords(const SamplingParams& p, int index) {
  if (p.logit_bias.empty() && p.allowed_token_ids.empty() && p.bad_words.empty() && !BansNow(p, index)) return 0;
  int64_t n = 4 + 2 * static_cast<int64_t>(p.logit_bias.size()) + static_cast<int64_t>(p.allowed_token_ids.size());
  if (BansNow(p, index)) n += static_cast<int64_t>(p.min_tokens_banned.size());
  for (const auto& w : p.bad_words) n += 1 + static_cast<int64_t>(w.size());
  return n;
}
int32_t* PackControls(const SamplingParams& p, int index, int32_t* out) {
  *out++ = static_cast<int32_t>(p.logit_bias.size());
  for (const auto& [t, b] : p.logit_bias) {
    *out++ = t;
    std::memcpy(out++, &b, sizeof(b));
  }
  *out++ = static_cast<int32_t>(p.allowed_token_ids.size());
  out = std::copy(p.allowed_token_ids.begin(), p.allowed_token_ids.end(), out);
  if (BansNow(p, index)) {
    *out++ = static_cast<int32_t>(p.min_tokens_banned.size());
    out = std::copy(p.min_tokens_banned.begin(), p.min_tokens_banned.end(), out);
  } else {
    *out++ = 0;
  }
  *out++ = static_cast<int32_t>(p.bad_words.size());
  for (const auto& w : p.bad_words) {
    *out++ = static_cast<int32_t>(w.size());
    out = std::copy(w.begin(), w.end(), out);
  }
  return out;
}

}  // namespace

absl::Status CudaBackend::AnswerOnDevice(absl::Span<const RowQuery> queries) {
  const int vocab = model_->config().vocab_size;
  const int n = static_cast<int>(queries.size());
  const int fed_limit = launched_ > 0 ? slots_[slot() ^ 1].n : 0;
  int64_t history = 0;
  int fed = 0;
  for (const RowQuery& r : queries) {
    if (r.row < 0 || r.row >= kept_) {
      return absl::InvalidArgumentError(absl::StrCat("query of row ", r.row, "; the step kept ", kept_, " rows"));
    }
    const int top_n = r.params == nullptr ? r.top_n : r.beam > 0 ? r.beam : r.params->logprobs;
    if (top_n > cuda::kMaxAnswerTop || (r.params == nullptr && (r.token < 0 || r.token >= vocab))) {
      return absl::InvalidArgumentError(absl::StrCat("query of token ", r.token, " with ", top_n,
                                                     " alternatives; allowed ids 0..", vocab - 1, ", up to ",
                                                     cuda::kMaxAnswerTop, " alternatives"));
    }
    if (r.fed_query >= fed_limit || (r.fed_query >= 0 && (r.params == nullptr || r.history.empty()))) {
      return absl::InvalidArgumentError(absl::StrCat("a history token fed from query ", r.fed_query,
                                                     " of the previous launch, which answered ", fed_limit));
    }
    if (r.params != nullptr && r.params->NeedsHistory()) {
      history += static_cast<int64_t>(r.history.size());
      fed += r.fed_query >= 0 ? 1 : 0;
    }
    if (r.params != nullptr) history += ControlWords(*r.params, r.index);
  }
  StepShape shape;
  shape.queries = n;
  shape.history = history;
  if (absl::Status st = ReserveStep(shape); !st.ok()) return st;  // within the largest step: no-op
  Slot& slot = slots_[this->slot()];
  const size_t q_bytes = n * sizeof(cuda::DeviceQuery), a_bytes = n * sizeof(cuda::DeviceAnswer);
  const size_t h_bytes = history * sizeof(int32_t), up_bytes = q_bytes + h_bytes + 2 * fed * sizeof(int32_t);
  if (absl::Status st = slot.sample_up.Reserve(up_bytes); !st.ok()) return st;
  if (absl::Status st = slot.answers.Reserve(a_bytes); !st.ok()) return st;
  if (absl::Status st = slot.answers_down.Reserve(a_bytes); !st.ok()) return st;
  auto* q = static_cast<cuda::DeviceQuery*>(slot.sample_up.ptr);
  auto* h = reinterpret_cast<int32_t*>(static_cast<char*>(slot.sample_up.ptr) + q_bytes);
  int32_t* feeds = h + history;  // (history index, query) pairs
  int32_t offset = 0, f = 0;
  for (int i = 0; i < n; ++i) {
    const RowQuery& r = queries[i];
    cuda::DeviceQuery d;
    d.row = r.row;
    if (r.params == nullptr) {
      d.token = r.token;
      d.top_n = r.top_n;
    } else {
      const SamplingParams& p = *r.params;
      d.draw = r.beam > 0 ? 2 : 1;
      d.top_n = r.beam > 0 ? r.beam : p.logprobs;
      d.temperature = p.temperature;
      d.top_p = p.top_p;
      d.repetition_penalty = p.repetition_penalty;
      d.top_k = p.top_k;
      d.seed = p.seed;
      d.index = r.index;
      d.presence_penalty = p.presence_penalty;
      d.frequency_penalty = p.frequency_penalty;
      d.min_p = p.min_p;
      d.no_repeat_ngram_size = p.no_repeat_ngram_size;
      if (p.NeedsHistory()) {
        d.history_offset = offset;
        d.history_len = static_cast<int32_t>(r.history.size());
        std::copy(r.history.begin(), r.history.end(), h + offset);
        offset += d.history_len;
        if (r.fed_query >= 0) {
          feeds[2 * f] = offset - 1;
          feeds[2 * f + 1] = r.fed_query;
          ++f;
        }
      }
      if (ControlWords(p, r.index) > 0) {
        d.controls_offset = offset;
        offset = PackControls(p, r.index, h + offset) - h;
      }
    }
    q[i] = d;
  }
  char* dev = static_cast<char*>(sample_.ptr);
  auto* d_queries = reinterpret_cast<cuda::DeviceQuery*>(dev);
  auto* d_history = reinterpret_cast<int32_t*>(dev + q_bytes);
  auto* d_feeds = reinterpret_cast<const int32_t*>(dev + q_bytes + h_bytes);
  auto* d_raw = reinterpret_cast<float*>(dev + up_bytes);
  auto* d_answers = static_cast<cuda::DeviceAnswer*>(slot.answers.ptr);
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(dev, slot.sample_up.ptr, up_bytes, cudaMemcpyHostToDevice, stream_));
  RELGEN_CUDA_RETURN(cuda::FeedTokens(FedFrom(), d_feeds, fed, d_history, stream_));
  RELGEN_CUDA_RETURN(cuda::AnswerRows(logits_d_.f(), vocab, d_queries, n, d_history, d_raw, nullptr, d_answers, stream_));
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(slot.answers_down.ptr, d_answers, a_bytes, cudaMemcpyDeviceToHost, stream_));
  RELGEN_CUDA_RETURN(cudaEventRecord(answered_[this->slot()], stream_));
  slot.n = n;
  return absl::OkStatus();
}

absl::Status CudaBackend::Collect(std::vector<SampleResult>* results) {
  if (collected_ == launched_) return absl::FailedPreconditionError("nothing launched to collect");
  const int k = static_cast<int>(collected_ & 1);
  ++collected_;
  if (!broken_.ok()) return broken_;
  if (const cudaError_t e = cudaEventSynchronize(answered_[k]); e != cudaSuccess) {
    cudaGetLastError();
    broken_ = absl::InternalError(absl::StrCat(DeviceName(), ": ", cudaGetErrorString(e)));
    return broken_;
  }
  const Slot& slot = slots_[k];
  const auto* a = static_cast<const cuda::DeviceAnswer*>(slot.answers_down.ptr);
  results->assign(slot.n, SampleResult());
  for (int i = 0; i < slot.n; ++i) {
    SampleResult& r = (*results)[i];
    r.token = a[i].token;
    r.logprob = a[i].logprob;
    for (int j = 0; j < a[i].num_top; ++j) r.top.push_back({a[i].top_token[j], a[i].top_logprob[j]});
  }
  return absl::OkStatus();
}
}  // namespace cuda_backend
}  // namespace relgen
