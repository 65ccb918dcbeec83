// The paged KV pool's shape, as a backend allocates it and the engine's accounting hands it out.
#pragma once

namespace relgen {

struct KvCacheConfig {
  int block_size = 16;  // tokens per block
  int num_blocks = 0;
};

inline int BlocksForTokens(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }

}  // namespace relgen
