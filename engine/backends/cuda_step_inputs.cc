// A step's inputs: its rows packed into one upload of metadata, then the encoder and the decoder run.
#include "engine/backends/cuda_backend_impl.h"

#include <algorithm>

namespace relgen {
namespace cuda_backend {

absl::Status CudaBackend::RunSteps(absl::Span<const SequenceStep> steps, std::vector<float>* logits) {
  const ModelConfig& c = model_->config();
  RELGEN_CUDA_RETURN(cudaSetDevice(device_));
  // Host-side metadata: tokens, each row's position and block-table offset, rows to keep.
  if (auto v = ValidateSteps(steps, c.vocab_size, c.max_seq_len, kv_, c.encoder_decoder); !v.ok()) return v;
  const bool enc_dec = c.encoder_decoder;
  auto lora_slot = LoraSlots(steps);
  if (!lora_slot.ok()) return lora_slot.status();
  const bool lora = std::any_of(lora_slot->begin(), lora_slot->end(), [](int s) { return s >= 0; });
  // With an adapter in the step: each decoder row's slot and each encoded row's (-1: none).
  std::vector<int32_t> lora_rows, enc_lora;
  std::vector<int32_t> tokens, position, table_offset, tables, keep;
  // Encoder-decoder only. Per decoder row, its cross-attention: the position of the input's last
  // token (every encoder key visible, as cpu::AttentionDecode at encoder_len - 1) and the offset
  // of its cross table in `tables`. Per row of each input encoded this step: its id, its position
  // in the input, its input's first row and length, its cross table's offset; `identity` is the
  // block table of the encoder's one-token blocks (Encode).
  std::vector<int32_t> cross_position, cross_offset, enc_ids, enc_position, enc_first, enc_len, enc_cross, identity;
  int max_keys = 1, max_input = 1, max_encoded = 1;
  std::vector<int32_t> feeds;  // (index into tokens, query of the previous launch) pairs
  const int fed_limit = launched_ > 0 ? slots_[slot() ^ 1].n : 0;
  for (size_t si = 0; si < steps.size(); ++si) {
    const SequenceStep& s = steps[si];
    const int n = static_cast<int>(s.tokens.size());
    if (lora) lora_rows.insert(lora_rows.end(), n, (*lora_slot)[si]);
    if (s.fed_query >= fed_limit) {
      return absl::InvalidArgumentError(absl::StrCat("a token fed from query ", s.fed_query,
                                                      " of the previous launch, which answered ", fed_limit));
    }
    if (s.fed_query >= 0) {
      feeds.push_back(static_cast<int32_t>(tokens.size()) + n - 1);
      feeds.push_back(s.fed_query);
    }
    const int offset = static_cast<int>(tables.size());
    tables.insert(tables.end(), s.block_table.begin(), s.block_table.end());
    const int cross = static_cast<int>(tables.size());
    if (enc_dec) tables.insert(tables.end(), s.cross_block_table.begin(), s.cross_block_table.end());
    for (int i = 0; i < n; ++i) {
      const int32_t t = s.tokens[i];
      if (s.all_logits || i == n - 1) keep.push_back(static_cast<int32_t>(tokens.size()));
      tokens.push_back(t);
      position.push_back(s.start_pos + i);
      table_offset.push_back(offset);
      if (enc_dec) {
        cross_position.push_back(s.encoder_len - 1);
        cross_offset.push_back(cross);
      }
    }
    max_keys = std::max(max_keys, s.start_pos + n);
    if (enc_dec) max_input = std::max(max_input, s.encoder_len);
    if (enc_dec && !s.encoder_tokens.empty()) {
      const int first = static_cast<int>(enc_ids.size());
      for (int i = 0; i < s.encoder_len; ++i) {
        enc_ids.push_back(s.encoder_tokens[i]);
        enc_position.push_back(i);
        enc_first.push_back(first);
        enc_len.push_back(s.encoder_len);
        enc_cross.push_back(cross);
        identity.push_back(first + i);
      }
      if (lora) enc_lora.insert(enc_lora.end(), s.encoder_len, (*lora_slot)[si]);
      max_encoded = std::max(max_encoded, s.encoder_len);
    }
  }
  const int total = static_cast<int>(tokens.size()), kept = static_cast<int>(keep.size());
  const int encoded = static_cast<int>(enc_ids.size());
  const int d = c.d_model, w = c.qkv_width();
  // Metadata in one upload: tokens | position | table_offset | keep, then (encoder-decoder)
  // cross_position | cross_offset | enc_ids | enc_position | enc_first | enc_len | enc_cross |
  // identity, then (with adapters) lora_rows | enc_lora, and last the block tables: every offset
  // but the tables' length follows from the row counts alone, which a captured decode graph relies on.
  std::vector<int32_t> meta;
  for (const auto* v : {&tokens, &position, &table_offset, &keep, &cross_position, &cross_offset, &enc_ids,
                        &enc_position, &enc_first, &enc_len, &enc_cross, &identity, &lora_rows, &enc_lora, &tables,
                        &feeds}) {
    meta.insert(meta.end(), v->begin(), v->end());
  }
  StepShape shape;
  shape.tokens = std::max(total, encoded);
  shape.kept = kept;
  shape.tables = static_cast<int64_t>(tables.size());
  shape.encoded = encoded;
  shape.fed = static_cast<int64_t>(feeds.size() / 2);
  shape.max_keys = std::max({max_keys, max_input, max_encoded});
  // Decode: one new token per sequence, only the last logits kept, nothing encoded. It replays a
  // graph whose attention grids span max_seq_len keys (DecodeGraph): its
  // workspace must hold that many splits for every row, also where the rows pass the largest step's.
  const bool decode = encoded == 0 && kept == total && total == static_cast<int>(steps.size());
  if (decode && options_.graphs) shape.max_keys = c.max_seq_len;
  if (absl::Status st = ReserveStep(shape); !st.ok()) return st;  // within the largest step: no-op
  // Up from page-locked memory: an asynchronous copy at the link's speed. The staging area is the
  // launch's slot, whose last user has been collected.
  PinnedBuffer& up = slots_[slot()].meta_up;
  if (absl::Status st = up.Reserve(meta.size() * sizeof(int32_t)); !st.ok()) return st;
  std::copy(meta.begin(), meta.end(), static_cast<int32_t*>(up.ptr));
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(meta_.ptr, up.ptr, meta.size() * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  // The fed tokens, from the previous launch's answers where they are.
  RELGEN_CUDA_RETURN(cuda::FeedTokens(FedFrom(), meta_.i() + meta.size() - feeds.size(), static_cast<int>(feeds.size() / 2),
                                      meta_.i(), stream_));
  StepRows step;
  step.total = total;
  step.kept = kept;
  step.max_keys = max_keys;
  step.max_input = max_input;
  step.tokens = meta_.i();
  step.keep = step.tokens + 3 * total;
  const int32_t* e = step.keep + kept + cross_position.size() + cross_offset.size();  // the encoded rows
  const int32_t* d_lora = e + 6 * encoded;
  const int32_t* d_tables = d_lora + lora_rows.size() + enc_lora.size();
  if (lora) step.lora = d_lora;
  cuda::Rows& rows = step.rows;
  rows.n = total;
  rows.position = step.tokens + total;
  rows.table_offset = step.tokens + 2 * total;
  rows.block_tables = d_tables;
  cuda::Rows& cross_rows = step.cross_rows;
  cross_rows = rows;
  cross_rows.position = step.keep + kept;
  cross_rows.table_offset = cross_rows.position + cross_position.size();
  if (encoded > 0) {
    cuda::Rows enc;  // e: ids | position | first | len | cross | identity, `encoded` each
    enc.n = encoded;
    enc.position = e + encoded;
    enc.table_offset = e + 2 * encoded;
    enc.keys = e + 3 * encoded;
    enc.block_tables = e + 5 * encoded;
    cuda::Rows write = enc;  // the same rows into their cross blocks
    write.keys = nullptr;
    write.table_offset = e + 4 * encoded;
    write.block_tables = d_tables;
    if (auto s = Encode(e, enc, max_encoded, write, lora ? d_lora + total : nullptr); !s.ok()) return s;
  }
  step.tiled = total > static_cast<int>(steps.size());
  if (auto s = decode && options_.graphs ? DecodeGraph(step) : Decoder(step); !s.ok()) return s;
  kept_ = kept;
  if (logits == nullptr) return absl::OkStatus();
  logits->resize(int64_t{kept} * c.vocab_size);
  RELGEN_CUDA_RETURN(cudaMemcpyAsync(logits->data(), logits_d_.ptr, logits->size() * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  RELGEN_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

// One step's operations, enqueued on stream_: x_ is the residual stream, h_ the branch input and
}  // namespace cuda_backend
}  // namespace relgen
