// Paged KV cache accounting. The backend owns the physical pool of `num_blocks` blocks of
// `block_size` tokens (every layer's K and V for those tokens); a sequence owns a block table, the
// list of pool blocks that hold its positions 0.. in order. BlockAllocator hands blocks out with
// exact accounting. Thread-safety: none; the engine thread owns it.
//
// Blocks are reference-counted, so sequences can share them (the samples of one request, the
// continuations of one Score call, prompts with a common prefix). Only full blocks are ever shared,
// and a full block is never written again, so a shared block is immutable and no copy-on-write is
// needed: a sequence whose prompt ends inside a block recomputes that block's tokens itself (fewer
// than block_size tokens) instead of copying it.
//
// Prefix cache: a full block can be registered under the identity of its contents, which is the
// block's tokens plus the identity of the block before it (a chain, so a block stands for the
// whole prefix up to its end) plus a root (whatever else the K/V depend on: for an
// encoder-decoder model, the encoder's input). When its last reference goes, a registered block is
// not freed but cached: it keeps its contents and its identity until the pool needs room, then the
// least recently released cached block is evicted. Lookups compare the stored tokens and root, not
// only a hash, so a hit is exact.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"
#include "engine/backends/kv_pool.h"

namespace relgen {

// Where a prefix chain stands: the canonical block holding the prefix so far, or the root.
struct PrefixCursor {
  int32_t block = -1;           // -1: at the root
  uint32_t generation = 0;      // of `block`, so an evicted and reused block id never matches
  uint64_t hash = 0;            // of the prefix so far (the root's hash at the root)
};

class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks, int block_size = 16);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  // Blocks Allocate can hand out: free ones and cached ones (evicted on demand).
  int num_free() const { return static_cast<int>(free_.size()) + num_cached_; }
  int num_used() const { return num_blocks_ - num_free(); }  // referenced by a sequence
  int num_cached() const { return num_cached_; }             // unreferenced, holding a prefix
  int ref_count(int32_t block) const { return meta_[block].refs; }
  int64_t num_evicted() const { return num_evicted_; }  // cached blocks reclaimed so far

  // Appends n blocks to `table`, all or none; false when fewer than n are free. Takes never-cached
  // blocks first, then evicts cached ones, least recently released first.
  bool Allocate(int n, std::vector<int32_t>* table);
  // Drops one reference to every block of `table` and clears it; a block nobody references becomes
  // free, or cached if it is registered. Releasing an unreferenced block is a bug: it aborts rather
  // than corrupting another sequence's cache.
  void Free(std::vector<int32_t>* table);
  // Appends `blocks` to `table`, adding a reference to each (they must be referenced or cached).
  void Share(absl::Span<const int32_t> blocks, std::vector<int32_t>* table);

  // The cursor a chain starts from: the root's tokens (empty for a decoder-only model).
  static PrefixCursor Root(absl::Span<const int32_t> root);
  // The registered block holding `tokens` (block_size of them) after `at`, or -1.
  int32_t Lookup(const PrefixCursor& at, absl::Span<const int32_t> tokens, absl::Span<const int32_t> root) const;
  // Registers full block `block` (referenced by the caller) as holding `tokens` after `at`, and
  // returns the cursor past it. When the same contents are already registered in another block,
  // that block stays canonical and the cursor points to it; `block` stays unregistered.
  PrefixCursor Register(const PrefixCursor& at, int32_t block, absl::Span<const int32_t> tokens,
                        absl::Span<const int32_t> root);
  // The cursor past a block known to hold `tokens` after `at` (a hit from Lookup).
  PrefixCursor Advance(const PrefixCursor& at, int32_t block, absl::Span<const int32_t> tokens) const;

  // Aborts when the books disagree with themselves (tests and debug checks).
  void CheckConsistency() const;

 private:
  struct Meta {
    int refs = 0;
    uint32_t generation = 0;  // bumped whenever the block's registration ends
    bool registered = false;
    uint64_t key = 0;         // map key while registered
    int32_t parent = -1;      // chain identity while registered
    uint32_t parent_generation = 0;
    std::vector<int32_t> tokens;
    std::shared_ptr<const std::vector<int32_t>> root;  // root-level blocks of a non-empty root
    int32_t lru_prev = -1, lru_next = -1;  // while cached
  };
  static uint64_t Key(const PrefixCursor& at, absl::Span<const int32_t> tokens);
  bool Matches(int32_t b, const PrefixCursor& at, absl::Span<const int32_t> tokens, absl::Span<const int32_t> root) const;
  void Unregister(int32_t b);
  void LruPush(int32_t b);  // most recent end
  void LruRemove(int32_t b);

  int num_blocks_;
  int block_size_;
  std::vector<Meta> meta_;
  std::vector<int32_t> free_;  // LIFO: recently freed blocks are reused first (warm in cache)
  int num_cached_ = 0;
  int64_t num_evicted_ = 0;
  int32_t lru_head_ = -1, lru_tail_ = -1;  // head: evicted first
  absl::flat_hash_map<uint64_t, int32_t> registry_;
};

}  // namespace relgen
