# Keeps a gemm.cc's kernels (everything before its allocation helpers) and adds an entry point
# Linear_<NAME> that runs its AVX2 kernel, so two builds link into one probe (gemm-inproc-ab.cc).
# python3 gemm-inproc-extract.py GEMM_CC NAME OUT_CC
import sys
src, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
s = open(src).read()
end = s.index('// 2 MiB or more on 2 MiB-aligned memory')
body = s[:end]
body += f'''
void Linear_{name}(const float* x, int rows, const PackedMatrix& w, const float* bias, float* y, ThreadPool* pool) {{
  Run(Kernel(GemmIsa::kAvx2, w.type()), x, rows, w, bias, y, pool);
}}
}}  // namespace relgen::cpu
'''
open(out, 'w').write(body)
