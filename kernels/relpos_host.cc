#include "kernels/relpos_host.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace relgen::relpos {
namespace {

// Unsigned big integer, little-endian 32-bit limbs: just enough to compare integer powers.
using BigUint = std::vector<uint32_t>;

void MulSmall(BigUint& x, uint32_t m) {
  uint64_t carry = 0;
  for (uint32_t& limb : x) {
    const uint64_t v = static_cast<uint64_t>(limb) * m + carry;
    limb = static_cast<uint32_t>(v);
    carry = v >> 32;
  }
  if (carry) x.push_back(static_cast<uint32_t>(carry));
}

BigUint Pow(uint32_t base, int exp) {
  BigUint x{1};
  for (int i = 0; i < exp; ++i) MulSmall(x, base);
  return x;
}

BigUint Mul(const BigUint& a, const BigUint& b) {
  BigUint r(a.size() + b.size(), 0);
  for (size_t i = 0; i < a.size(); ++i) {
    uint64_t carry = 0;
    for (size_t j = 0; j < b.size(); ++j) {
      const uint64_t v = static_cast<uint64_t>(a[i]) * b[j] + r[i + j] + carry;
      r[i + j] = static_cast<uint32_t>(v);
      carry = v >> 32;
    }
    r[i + b.size()] += static_cast<uint32_t>(carry);
  }
  while (r.size() > 1 && r.back() == 0) r.pop_back();
  return r;
}

bool LessEqual(const BigUint& a, const BigUint& b) {
  if (a.size() != b.size()) return a.size() < b.size();
  for (size_t i = a.size(); i-- > 0;) {
    if (a[i] != b[i]) return a[i] < b[i];
  }
  return true;
}

// Bucket of a non-negative distance n among `buckets` buckets (one direction).
int OneSidedBucket(uint32_t n, uint32_t buckets, uint32_t max_distance) {
  const uint32_t max_exact = buckets / 2;
  if (n < max_exact) return static_cast<int>(n);
  const int span = static_cast<int>(buckets - max_exact);
  // (max_distance/max_exact)^k <= (n/max_exact)^span
  //   <=> max_distance^k * max_exact^span <= n^span * max_exact^k
  const BigUint n_pow = Pow(n, span);
  int k = 0;
  while (k + 1 < span) {
    const BigUint lhs = Mul(Pow(max_distance, k + 1), Pow(max_exact, span));
    const BigUint rhs = Mul(n_pow, Pow(max_exact, k + 1));
    if (!LessEqual(lhs, rhs)) break;
    ++k;
  }
  return std::min<int>(static_cast<int>(max_exact) + k, static_cast<int>(buckets) - 1);
}

}  // namespace

int T5Bucket(int relative_position, int num_buckets, int max_distance, bool bidirectional) {
  int offset = 0;
  uint32_t buckets = static_cast<uint32_t>(num_buckets);
  uint32_t n;
  if (bidirectional) {
    buckets /= 2;
    if (relative_position > 0) offset = static_cast<int>(buckets);
    n = static_cast<uint32_t>(std::abs(relative_position));
  } else {
    n = static_cast<uint32_t>(std::max(-relative_position, 0));
  }
  return offset + OneSidedBucket(n, buckets, static_cast<uint32_t>(max_distance));
}

std::vector<int32_t> T5BucketTable(int num_buckets, int max_distance, bool bidirectional) {
  std::vector<int32_t> table(static_cast<size_t>(max_distance) + 1);
  for (int d = 0; d <= max_distance; ++d) {
    table[d] = T5Bucket(-d, num_buckets, max_distance, bidirectional);
  }
  return table;
}

std::vector<int32_t> T5SignedBucketTable(int num_buckets, int max_distance) {
  std::vector<int32_t> table(2 * static_cast<size_t>(max_distance) + 1);
  for (int r = -max_distance; r <= max_distance; ++r) {
    table[r + max_distance] = T5Bucket(r, num_buckets, max_distance, /*bidirectional=*/true);
  }
  return table;
}

std::vector<float> AlibiSlopes(int num_heads, double max_bias) {
  int p = 1;
  while (p < num_heads) p *= 2;
  std::vector<double> all(p);
  for (int i = 0; i < p; ++i) all[i] = std::pow(2.0, -max_bias * (i + 1) / p);
  std::vector<float> slopes;
  if (p == num_heads) return std::vector<float>(all.begin(), all.end());
  for (int i = 1; i < p; i += 2) slopes.push_back(static_cast<float>(all[i]));
  for (int i = 0; static_cast<int>(slopes.size()) < num_heads; i += 2) slopes.push_back(static_cast<float>(all[i]));
  return slopes;
}

}  // namespace relgen::relpos
