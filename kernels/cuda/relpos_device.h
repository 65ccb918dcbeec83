// Host entry to the device-side relative-position index functions (used by parity tests).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/relpos.h"

namespace relgen::cuda {

// out_host [n, n]: for visible pairs (key <= query, inside the window) the table row / bucket /
// distance the device computes; -2 elsewhere. `param` is M (skew), k (Shaw); t5_table may be null.
cudaError_t RelIndices(relpos::Scheme scheme, int param, int block_length, int n,
                       const int32_t* t5_table_host, int t5_len, int32_t* out_host);

}  // namespace relgen::cuda
