#include "engine/core/kv_cache.h"

#include <cstdio>
#include <cstdlib>

namespace relgen {

BlockAllocator::BlockAllocator(int num_blocks) : num_blocks_(num_blocks), in_use_(num_blocks, 0) {
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool BlockAllocator::Allocate(int n, std::vector<int32_t>* table) {
  if (n > num_free()) return false;
  for (int i = 0; i < n; ++i) {
    const int32_t b = free_.back();
    free_.pop_back();
    in_use_[b] = 1;
    table->push_back(b);
  }
  return true;
}

void BlockAllocator::Free(std::vector<int32_t>* table) {
  for (int32_t b : *table) {
    if (b < 0 || b >= num_blocks_ || !in_use_[b]) {
      std::fprintf(stderr, "relgen: KV block %d freed twice or never allocated\n", b);
      std::abort();
    }
    in_use_[b] = 0;
    free_.push_back(b);
  }
  table->clear();
}

}  // namespace relgen
