#include "engine/core/kv_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/hash/hash.h"

namespace relgen {
namespace {

[[noreturn]] void Corrupt(const char* what, int32_t b) {
  std::fprintf(stderr, "relgen: KV block %d %s\n", b, what);
  std::abort();
}

uint64_t Mix(uint64_t h, uint64_t v) {
  return absl::HashOf(h, v);
}

}  // namespace

BlockAllocator::BlockAllocator(int num_blocks, int block_size)
    : num_blocks_(num_blocks), block_size_(block_size), meta_(num_blocks) {
  free_.reserve(num_blocks);
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
}

bool BlockAllocator::Allocate(int n, std::vector<int32_t>* table) {
  if (n > num_free()) return false;
  for (int i = 0; i < n; ++i) {
    int32_t b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = lru_head_;
      LruRemove(b);
      Unregister(b);
      ++num_evicted_;
    }
    meta_[b].refs = 1;
    table->push_back(b);
  }
  return true;
}

void BlockAllocator::Free(std::vector<int32_t>* table) {
  // Last block first: a chain's deepest blocks are evicted before the prefixes others may share.
  for (auto it = table->rbegin(); it != table->rend(); ++it) {
    const int32_t b = *it;
    if (b < 0 || b >= num_blocks_ || meta_[b].refs <= 0) Corrupt("freed twice or never allocated", b);
    if (--meta_[b].refs > 0) continue;
    if (meta_[b].registered) {
      LruPush(b);
    } else {
      free_.push_back(b);
    }
  }
  table->clear();
}

void BlockAllocator::Share(absl::Span<const int32_t> blocks, std::vector<int32_t>* table) {
  for (int32_t b : blocks) {
    if (b < 0 || b >= num_blocks_) Corrupt("shared but out of the pool", b);
    Meta& m = meta_[b];
    if (m.refs == 0) {
      if (!m.registered) Corrupt("shared while free", b);
      LruRemove(b);
    }
    ++m.refs;
    table->push_back(b);
  }
}

PrefixCursor BlockAllocator::Root(absl::Span<const int32_t> root) {
  PrefixCursor c;
  c.hash = absl::HashOf(root);
  return c;
}

uint64_t BlockAllocator::Key(const PrefixCursor& at, absl::Span<const int32_t> tokens) {
  return Mix(Mix(at.hash, absl::HashOf(tokens)), (uint64_t{static_cast<uint32_t>(at.block)} << 32) | at.generation);
}

bool BlockAllocator::Matches(int32_t b, const PrefixCursor& at, absl::Span<const int32_t> tokens,
                             absl::Span<const int32_t> root) const {
  const Meta& m = meta_[b];
  if (!m.registered || m.parent != at.block || m.parent_generation != at.generation) return false;
  if (!std::equal(m.tokens.begin(), m.tokens.end(), tokens.begin(), tokens.end())) return false;
  if (at.block >= 0) return true;  // the parent's identity covers the root
  if (m.root == nullptr) return root.empty();
  return std::equal(m.root->begin(), m.root->end(), root.begin(), root.end());
}

int32_t BlockAllocator::Lookup(const PrefixCursor& at, absl::Span<const int32_t> tokens,
                               absl::Span<const int32_t> root) const {
  auto it = registry_.find(Key(at, tokens));
  if (it == registry_.end() || !Matches(it->second, at, tokens, root)) return -1;
  return it->second;
}

PrefixCursor BlockAllocator::Advance(const PrefixCursor& at, int32_t block, absl::Span<const int32_t> tokens) const {
  PrefixCursor next;
  next.block = block;
  next.generation = meta_[block].generation;
  next.hash = Mix(at.hash, absl::HashOf(tokens));
  return next;
}

PrefixCursor BlockAllocator::Register(const PrefixCursor& at, int32_t block, absl::Span<const int32_t> tokens,
                                      absl::Span<const int32_t> root) {
  if (static_cast<int>(tokens.size()) != block_size_) Corrupt("registered with a partial block", block);
  if (meta_[block].refs <= 0) Corrupt("registered while unreferenced", block);
  const uint64_t key = Key(at, tokens);
  auto [it, inserted] = registry_.try_emplace(key, block);
  if (!inserted) {
    // Same contents elsewhere (or, vanishingly rarely, a hash collision: then `block` just stays
    // unregistered and the chain continues from it).
    if (Matches(it->second, at, tokens, root)) return Advance(at, it->second, tokens);
    return Advance(at, block, tokens);
  }
  if (meta_[block].registered) {  // already canonical for other contents: cannot happen for a full block
    registry_.erase(it);
    Corrupt("registered twice", block);
  }
  Meta& m = meta_[block];
  m.registered = true;
  m.key = key;
  m.parent = at.block;
  m.parent_generation = at.generation;
  m.tokens.assign(tokens.begin(), tokens.end());
  m.root = at.block < 0 && !root.empty() ? std::make_shared<const std::vector<int32_t>>(root.begin(), root.end())
                                         : nullptr;
  return Advance(at, block, tokens);
}

void BlockAllocator::Unregister(int32_t b) {
  Meta& m = meta_[b];
  if (!m.registered) return;
  registry_.erase(m.key);
  m.registered = false;
  m.tokens.clear();
  m.root.reset();
  ++m.generation;  // chains through this block no longer match
}

void BlockAllocator::LruPush(int32_t b) {
  Meta& m = meta_[b];
  m.lru_prev = lru_tail_;
  m.lru_next = -1;
  if (lru_tail_ >= 0) meta_[lru_tail_].lru_next = b;
  lru_tail_ = b;
  if (lru_head_ < 0) lru_head_ = b;
  ++num_cached_;
}

void BlockAllocator::LruRemove(int32_t b) {
  Meta& m = meta_[b];
  if (m.lru_prev >= 0) {
    meta_[m.lru_prev].lru_next = m.lru_next;
  } else {
    lru_head_ = m.lru_next;
  }
  if (m.lru_next >= 0) {
    meta_[m.lru_next].lru_prev = m.lru_prev;
  } else {
    lru_tail_ = m.lru_prev;
  }
  m.lru_prev = m.lru_next = -1;
  --num_cached_;
}

void BlockAllocator::CheckConsistency() const {
  int cached = 0, free_count = 0, referenced = 0;
  std::vector<uint8_t> in_free(num_blocks_, 0);
  for (int32_t b : free_) {
    if (in_free[b]++ || meta_[b].refs != 0 || meta_[b].registered) Corrupt("in the free list wrongly", b);
    ++free_count;
  }
  for (int32_t b = lru_head_, prev = -1; b >= 0; prev = b, b = meta_[b].lru_next) {
    if (meta_[b].lru_prev != prev || meta_[b].refs != 0 || !meta_[b].registered || in_free[b]) {
      Corrupt("in the cached list wrongly", b);
    }
    ++cached;
  }
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (meta_[b].refs < 0) Corrupt("has a negative reference count", b);
    if (meta_[b].refs > 0) ++referenced;
    if (meta_[b].registered) {
      auto it = registry_.find(meta_[b].key);
      if (it == registry_.end() || it->second != b) Corrupt("registered but not in the registry", b);
    }
  }
  if (cached != num_cached_ || cached + free_count + referenced != num_blocks_) Corrupt("books do not add up", -1);
}

}  // namespace relgen
