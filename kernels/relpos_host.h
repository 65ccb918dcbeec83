// Host-only builders for the relative-position tables that must be exact: T5 buckets (a float `log`
// can move a boundary that sits on an integer) and ALiBi slopes.
#pragma once

#include <cstdint>
#include <vector>

namespace relgen::relpos {

// T5's bucket for relative_position = key_pos - query_pos, computed exactly with integers:
// bucket = max_exact + the largest k with (max_distance/max_exact)^k <= (n/max_exact)^S, where
// S = buckets - max_exact, clamped to the last bucket. With `bidirectional` half of the buckets
// are for positive relative positions. Requires num_buckets >= 2 (>= 4 bidirectional) and
// max_distance > num_buckets/2 (resp. /4).
int T5Bucket(int relative_position, int num_buckets, int max_distance, bool bidirectional);

// Bucket of each causal distance 0..max_distance (every larger distance maps to the last entry).
std::vector<int32_t> T5BucketTable(int num_buckets, int max_distance, bool bidirectional);
// Bidirectional buckets of each relative position r = key_pos - query_pos in
// [-max_distance, max_distance], at index r + max_distance (farther positions clamp to the ends).
std::vector<int32_t> T5SignedBucketTable(int num_buckets, int max_distance);

// ALiBi slopes: for n a power of two, 2^(-max_bias(h+1)/n); otherwise the slopes of the next power
// of two P above n, the even-numbered ones (h = 2, 4, ...) first, then the odd, the first n kept.
// With max_bias 8 that is the ALiBi paper's rule (the closest power of two p below n, then every
// other slope of 2p: BLOOM's); MPT makes max_bias a config value (alibi_bias_max).
std::vector<float> AlibiSlopes(int num_heads, double max_bias = 8.0);

}  // namespace relgen::relpos
