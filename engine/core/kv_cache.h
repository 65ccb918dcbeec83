// Paged KV cache accounting. The backend owns the physical pool of `num_blocks` blocks of
// `block_size` tokens (every layer's K and V for those tokens); a sequence owns a block table, the
// list of pool blocks that hold its positions 0.. in order. BlockAllocator hands blocks out with
// exact accounting. Thread-safety: none; the engine thread owns it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace relgen {

struct KvCacheConfig {
  int block_size = 16;  // tokens per block
  int num_blocks = 0;
};

inline int BlocksForTokens(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }

class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);

  int num_blocks() const { return num_blocks_; }
  int num_free() const { return static_cast<int>(free_.size()); }
  int num_used() const { return num_blocks_ - num_free(); }

  // Appends n blocks to `table`, all or none; false when fewer than n are free.
  bool Allocate(int n, std::vector<int32_t>* table);
  // Returns every block of `table` to the pool and clears it. A block freed twice is a bug: it
  // aborts rather than corrupting another sequence's cache.
  void Free(std::vector<int32_t>* table);

 private:
  int num_blocks_;
  std::vector<int32_t> free_;     // LIFO: recently freed blocks are reused first (warm in cache)
  std::vector<uint8_t> in_use_;
};

}  // namespace relgen
