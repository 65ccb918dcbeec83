// Helpers shared by the tests: golden files, model directories, a safetensors writer.
#pragma once

#include <unistd.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace relgen::testing {

// Directory written by tools/make_goldens.py (set by CTest).
inline std::string GoldenDir() {
  const char* d = std::getenv("RELGEN_GOLDEN_DIR");
  return d != nullptr ? d : "";
}

// What a float stored as bf16 means, written apart from the kernels: bf16 keeps 8 significant
// bits, so the spacing at x is 2^(exponent - 7); round to nearest, ties to even.
inline double Bf16Value(float x) {
  const double step = x == 0 ? 1.0 : std::ldexp(1.0, std::ilogb(x) - 7);
  return std::nearbyint(x / step) * step;
}

inline nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The golden cases' names (one per relative scheme and variant); empty where the fixture did not run.
inline std::vector<std::string> GoldenCases() {
  const std::string dir = GoldenDir();
  if (dir.empty()) return {};
  std::vector<std::string> cases;
  const nlohmann::json manifest = ReadJson(dir + "/manifest.json");
  for (const auto& c : manifest["cases"]) cases.push_back(c);
  return cases;
}

inline void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A safetensors file from raw parts: header JSON text and the data bytes.
inline std::string SafetensorsBytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// Fresh empty directory under the test's temp dir.
// A fresh directory for `name`, private to this process (test runs of several checkouts may share
// the machine).
inline std::string TempDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "relgen_" + name + "_" + std::to_string(getpid());
  std::system(("rm -rf '" + dir + "' && mkdir -p '" + dir + "'").c_str());
  return dir;
}

// Row-wise closeness: max |got - want| over a row <= rtol * max |want| over that row.
inline void ExpectRowsClose(const float* got, const double* want, int rows, int cols, double rtol,
                            const std::string& what) {
  for (int r = 0; r < rows; ++r) {
    double max_ref = 0, max_err = 0;
    for (int c = 0; c < cols; ++c) {
      max_ref = std::max(max_ref, std::abs(want[int64_t{r} * cols + c]));
      max_err = std::max(max_err, std::abs(got[int64_t{r} * cols + c] - want[int64_t{r} * cols + c]));
    }
    ASSERT_LE(max_err, rtol * max_ref) << what << ": row " << r << " of " << rows;
  }
}

}  // namespace relgen::testing
