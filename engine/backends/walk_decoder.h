// The decoder's layer order, written once for every backend: a backend supplies the operations
// (an Ops struct, below) over its own buffers and kernels, and WalkDecoder calls them in the order
// the model's config asks for. What differs between backends (fusions, where a residual is added,
// how rows are split over threads or grids) lives in their Ops; the order does not.
//
// Ops holds, as state of its own, a step's rows and two row sets of width d_model: the residual
// stream (the embeddings, then each block's output added to them) and the branch input (a block's
// normalized input, pre-norm). Each call returns absl::Status (a device's launch may fail); the walk
// stops at the first error.
//
//   Embed()                      tokens' embeddings (times the embedding scale) into the stream
//   Norm(which, layer, at)       norm `which` (of `layer`, -1 for the model's own) at `at`
//   QkvToCache(layer, in)        q of `in` kept, its k and v written into the layer's K/V cache
//   Attention(layer)             q over the cache (causal, the layer's relative term), its output
//                                projection added to the stream
//   CrossAttention(layer)        encoder-decoder: q of the branch input over the input's K/V (no
//                                relative term), its output projection added to the stream
//   FeedForward(layer, in)       the feed-forward block on `in`, its output added to the stream
//   GatherRows()                 the rows whose logits are wanted, out of the stream
//   LmHead()                     the gathered rows' logits (times the LM head's input scale)
//
// The encoder of an encoder-decoder model is a separate pass over other rows (bidirectional, its
// own layers), run before this walk by each backend.
#pragma once

#include "absl/status/status.h"
#include "engine/model/config.h"

namespace relgen {

// Which of a model's norms.
enum class NormOf { kEmbedding, kAttention, kCross, kFeedForward, kFinal };

// Where a norm reads and writes, and what a projection reads: the residual stream in place (post-
// norm; the embedding norm), from the stream into the branch input (pre-norm), or the gathered rows
// in place (the final norm).
enum class RowsAt { kStream, kBranch, kGathered };

#define RELGEN_WALK_RETURN(expr)                 \
  do {                                           \
    if (absl::Status _w = (expr); !_w.ok()) {    \
      return _w;                                 \
    }                                            \
  } while (0)

template <typename Ops>
absl::Status WalkDecoder(const ModelConfig& c, Ops& ops) {
  const bool pre = c.norm_placement == NormPlacement::kPre;
  // A block reads its normalized input (pre-norm) or the stream itself (post-norm, normalized after
  // the block's residual add).
  const RowsAt in = pre ? RowsAt::kBranch : RowsAt::kStream;
  RELGEN_WALK_RETURN(ops.Embed());
  if (c.embedding_norm) RELGEN_WALK_RETURN(ops.Norm(NormOf::kEmbedding, -1, RowsAt::kStream));
  for (int l = 0; l < c.n_layers; ++l) {
    if (pre) RELGEN_WALK_RETURN(ops.Norm(NormOf::kAttention, l, RowsAt::kBranch));
    RELGEN_WALK_RETURN(ops.QkvToCache(l, in));
    RELGEN_WALK_RETURN(ops.Attention(l));
    if (!pre) RELGEN_WALK_RETURN(ops.Norm(NormOf::kAttention, l, RowsAt::kStream));
    if (c.encoder_decoder) {
      // Cross-attention is pre-normalized whatever the placement of the other blocks (T5).
      RELGEN_WALK_RETURN(ops.Norm(NormOf::kCross, l, RowsAt::kBranch));
      RELGEN_WALK_RETURN(ops.CrossAttention(l));
    }
    if (pre) RELGEN_WALK_RETURN(ops.Norm(NormOf::kFeedForward, l, RowsAt::kBranch));
    RELGEN_WALK_RETURN(ops.FeedForward(l, in));
    if (!pre) RELGEN_WALK_RETURN(ops.Norm(NormOf::kFeedForward, l, RowsAt::kStream));
  }
  // Only the wanted rows go through the final norm and the vocabulary projection.
  RELGEN_WALK_RETURN(ops.GatherRows());
  if (pre) RELGEN_WALK_RETURN(ops.Norm(NormOf::kFinal, -1, RowsAt::kGathered));
  return ops.LmHead();
}

#undef RELGEN_WALK_RETURN

}  // namespace relgen
