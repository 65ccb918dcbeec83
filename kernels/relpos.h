// Relative-position index arithmetic shared by the CPU kernels, the CUDA kernels and the tests.
// Every function is a pure inline function usable on host and device. Positions are absolute
// sequence positions (the token's cache position), never offsets inside a buffer or a chunk.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define RELGEN_HD __host__ __device__ __forceinline__
#else
#define RELGEN_HD inline
#endif

namespace relgen::relpos {

enum class Scheme : int32_t {
  kNone = 0,
  kSkew = 1,       // Music Transformer, global
  kSkewLocal = 2,  // Music Transformer, blocked local
  kShaw = 3,       // clipped relative keys (and optional values)
  kT5 = 4,         // bucketed per-head scalar bias
  kAlibi = 5,      // per-head linear slope
};

// Skew table E has `num_rows` rows ordered by distance -(num_rows-1) ... 0: row r holds distance
// num_rows-1-r. Returns the row for distance = query_pos - key_pos >= 0, or -1 when the distance has
// no row (the relative logit is then zero, as in tensor2tensor v2; it is not clipped).
RELGEN_HD int SkewRow(int distance, int num_rows) {
  return distance < num_rows ? num_rows - 1 - distance : -1;
}

// Blocked local attention: blocks of `block_length` reset at block boundaries. A query in block b
// sees block b-1 and block b up to itself. Returns the first key position the query may see.
RELGEN_HD int LocalWindowStart(int query_pos, int block_length) {
  const int block = query_pos / block_length;
  return block > 0 ? (block - 1) * block_length : 0;
}

// First key position visible to a causal query for this scheme (0 for all but local).
RELGEN_HD int WindowStart(Scheme scheme, int query_pos, int block_length) {
  return scheme == Scheme::kSkewLocal ? LocalWindowStart(query_pos, block_length) : 0;
}

// Shaw: table of 2k+1 rows for clipped relative positions j-i in [-k, k]; row = clip(j-i,-k,k)+k.
// Beyond k the edge row repeats (clip), unlike the skew's zero.
RELGEN_HD int ShawRow(int query_pos, int key_pos, int clip_k) {
  int rel = key_pos - query_pos;
  rel = rel < -clip_k ? -clip_k : (rel > clip_k ? clip_k : rel);
  return rel + clip_k;
}

// T5: bucket of distance = query_pos - key_pos >= 0, looked up in a table built on the host with
// exact arithmetic (see relpos_host.h). The table covers distances 0..table_len-1; every larger
// distance falls in the table's last bucket.
RELGEN_HD int T5BucketOfDistance(const int32_t* table, int table_len, int distance) {
  return table[distance < table_len ? distance : table_len - 1];
}

// ALiBi: -slope_h * (i - j).
RELGEN_HD float AlibiBias(float slope, int distance) { return -slope * static_cast<float>(distance); }

}  // namespace relgen::relpos
