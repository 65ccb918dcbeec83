#!/usr/bin/env python3
"""Register and local-memory budget of the CUDA kernels (ctest cuda_resources, label cuda_build).

Compiles every kernels/cuda/*.cu with nvcc --resource-usage for each checked architecture (sm_80,
sm_90), with the real build's flags (CMake passes them; see tests/CMakeLists.txt), parses ptxas's
per-function report and fails when, for any kernel on any architecture:
  - ptxas spilled registers (spill stores or spill loads > 0 bytes);
  - the kernel uses more registers per thread than its budget below;
  - the kernel has a stack frame (local memory) larger than its budget below (0 for every kernel
    today): with spills it is where the spills went, without them it is a per-thread array that
    left the registers (qr/acc in AttentionKernel, say) or an ABI call, both a slowdown here;
  - a kernel has no budget (a new kernel: give it one below), or a budget names a kernel that no
    longer compiles (renamed or removed: update the table).
Only python3's standard library; needs nvcc, no GPU. Exit status 0 = pass, 1 = a budget is broken,
2 = nvcc or the parse failed.

Testing the check itself (never in CI): --extra-flags=-maxrregcount=16 (or the environment variable
RELGEN_CUDA_RESOURCES_EXTRA_FLAGS) forces spills; --regs-cap N caps every register budget at N.
"""
import argparse
import concurrent.futures
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

# ---------------------------------------------------------------------------------------------
# Budgets: the one place to change. Registers are per thread; `threads` is the block size the
# kernel is launched with (kernels/cuda/*.cu host code) -- change it here when a launch changes.
#
# Occupancy arithmetic, the same on sm_80 (A100) and sm_90 (H100): 65536 registers per SM,
# allocated per warp in units of 256 (so per thread in steps of 8), at most 64 resident warps
# (2048 threads) and 32 resident blocks per SM. A kernel of R registers launched with T threads
# fits floor(65536 / (R * T)) blocks per SM on registers alone (R a multiple of 8). Each budget
# is the largest R that keeps the kernel at or above its intended minimum occupancy:
#   - streaming kernels (elementwise, embedding gather, row norm, KV scatter, index fill): memory
#     bound with no per-thread state, they want every warp slot to hide DRAM latency: 100%
#     (64 warps/SM). At 256 threads that is 8 blocks -> R <= 65536/(8*256) = 32; at 64 threads
#     the 32-block cap binds first and R <= 65536/(32*64) = 32 as well. Measured 10-22.
#   - AttentionKernel (128 threads; q in shared memory; each lane owns one key of a 32-key tile
#     (four partial dot sums over 16-byte loads, eight in flight) and the accumulator for 8 output
#     dims, acc[8], plus its online-softmax state; the V loop 8 keys deep): at least 4 blocks =
#     16 warps/SM (25%); R <= 65536/(4*128) = 128, which `__launch_bounds__(128, 4)` hands ptxas.
#     Decode attention is bound by round trips to memory, not by occupancy: on an H200, 8 loads in
#     flight at 4 blocks/SM beat 2 at 6 blocks/SM (80 registers) by 20% at batch 1 and 8-17% at
#     batch 64 (docs/gpu-performance.md). Measured 120-128, no spills. 25% is the floor below
#     which a change should be a deliberate decision (retune, or lower the target here).
#     Its dynamic shared memory (q, the warps' merge, each warp's tile of weights, row offsets and
#     Shaw rows: AttentionSharedBytes), <= 7200 bytes per block at head_dim 256,
#     allows far more than 4 blocks on either architecture, so registers are the binding limit.
#   - AttentionTileKernel (128 threads, prefill): the per-row kernel's work for 4 query rows at once,
#     so a lane keeps 4 rows' partial dot sums, online-softmax state and accumulators (2 or 8 output
#     dims each): at least 4 blocks = 16 warps/SM (25%); R <= 65536/(4*128) = 128, which
#     `__launch_bounds__(128, 4)` hands ptxas. Measured 80-128 (sm_80 and sm_90), no spills. Each block
#     does 4 rows' work, and a prefill grid has thousands of blocks, so 25% still fills the SMs.
#   - LinearKernel (128 threads, the batch-invariant projection): a lane keeps 4 rows x 4 outputs
#     of partial sums and two rounds of 16-byte loads in flight (the one-row variant: one output,
#     eight loads in flight); a round trip to memory per round is what bounds it on a GPU (measured
#     on an H200: one load in flight per round left the batch-64 FFN down projection at 90 us), so
#     registers go to loads in flight rather than to occupancy: at least 4 blocks = 16 warps/SM
#     (25%): R <= 65536/(4*128) = 128, which `__launch_bounds__(128, 4)` hands ptxas. Measured
#     82-126 (sm_80 and sm_90), no spills.
#   - CombineKernel (64 threads, split-K merge, runs only when keys are split): at least 50%
#     (32 warps = 16 blocks): R <= 65536/(16*64) = 64. Measured 32 (sm_80) and 40 (sm_90).
# `stack` is the allowed stack frame (local memory) in bytes; spills are never allowed.
# ---------------------------------------------------------------------------------------------


class Budget(NamedTuple):
    threads: int  # block size at launch
    regs: int  # max registers per thread
    stack: int = 0  # max stack frame bytes


BUDGETS = {
    # kernels/cuda/elementwise.cu, linear.cu, kv_write.cu, attention.cu
    "EmbeddingKernel": Budget(threads=256, regs=32),  # 100%: 8 blocks x 8 warps
    "NormKernel": Budget(threads=256, regs=32),  # 100%
    "BiasActivateKernel": Budget(threads=256, regs=32),  # 100%
    "GatedKernel": Budget(threads=256, regs=32),  # 100%
    "AddKernel": Budget(threads=256, regs=32),  # 100%
    "RoundToBf16Kernel": Budget(threads=256, regs=32),  # 100%: cuBLAS's bf16 operand, one element a thread
    "WriteKvKernel": Budget(threads=64, regs=32),  # 100%: 32 blocks x 2 warps
    "AttentionKernel": Budget(threads=128, regs=128),  # >= 25%: 4 blocks x 4 warps; causal and bidirectional
    "AttentionTileKernel": Budget(threads=128, regs=128),  # >= 25%: 4 blocks x 4 warps (4 query rows of state per lane)
    "CombineKernel": Budget(threads=64, regs=64),  # >= 50%: 16 blocks x 2 warps
    # kernels/cuda/attention_mma.cu: >= 25%: 4 blocks x 4 warps (41 KB of shared memory at head_dim
    # 128 allows 5 a SM on sm_90); the row's 16 output elements a thread and the fragments
    "AttentionMmaKernel": Budget(threads=128, regs=128),
    "LinearKernel": Budget(threads=128, regs=128),  # >= 25%: 4 blocks x 4 warps (loads in flight over occupancy)
    # >= 37.5%: 6 blocks x 4 warps (tensor cores; 64 registers spill on sm_90 since the 64-deep staging)
    "LinearMmaKernel": Budget(threads=128, regs=80),
    # >= 25%: 4 blocks x 4 warps (64 x 64 tiles, four accumulators a warp; 41 KB of shared memory caps
    # sm_80 at 4 blocks anyway)
    "LinearMmaWideKernel": Budget(threads=128, regs=128),
    # kernels/cuda/sampler_kernels.cu
    "AnswerRowsKernel": Budget(threads=256, regs=64),  # >= 50%: 4 blocks x 8 warps (a block per row, L2-bound passes)
    "FeedTokensKernel": Budget(threads=256, regs=32),  # 100%
    # kernels/cuda/relpos_device.cu
    "RelIndexKernel": Budget(threads=256, regs=32),  # 100% (16x16 blocks)
    # kernels/cuda/lora.cu: 100%: 8 blocks x 8 warps (a block per row and range of 256 outputs)
    "LoraAddKernel": Budget(threads=256, regs=32),
}

ARCHS = ("80", "90")  # A100 and H100; the build itself targets CMAKE_CUDA_ARCHITECTURES (90)
# CMake's RelWithDebInfo CUDA flags plus the project's CUDA standard; CMake passes the real ones.
DEFAULT_FLAGS = "-O2 -g -DNDEBUG -std=c++17"

REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM, REG_UNIT = 65536, 64, 32, 256


def blocks_per_sm(regs, threads):
    """Resident blocks per SM allowed by registers and the warp/block caps (sm_80 and sm_90)."""
    warps = -(-threads // 32)
    per_warp = max(1, -(-regs * 32 // REG_UNIT)) * REG_UNIT
    return min((REGS_PER_SM // per_warp) // warps, MAX_WARPS_PER_SM // warps, MAX_BLOCKS_PER_SM)


def occupancy(regs, threads):
    b = blocks_per_sm(regs, threads)
    return b, 100.0 * b * (-(-threads // 32)) / MAX_WARPS_PER_SM


def short_name(mangled):
    """The unqualified function name of an Itanium-mangled symbol (relgen::cuda::(anon)::AddKernel
    -> AddKernel); the symbol itself when it is not mangled or does not parse."""
    m = re.match(r"_ZN?", mangled)
    if not m:
        return mangled
    i, last = m.end(), None
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while j < len(mangled) and mangled[j].isdigit():
            j += 1
        n = int(mangled[i:j])
        last, i = mangled[j:j + n], j + n
        if not mangled.startswith("_ZN"):
            break
    return last or mangled


class Func:
    def __init__(self, mangled, arch):
        self.mangled, self.arch, self.name = mangled, arch, short_name(mangled)
        self.entry = False
        self.regs = self.stack = self.spill_st = self.spill_ld = None
        self.smem = self.lmem = 0
        self.source = ""


ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
PROPS = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def parse_ptxas(text, default_arch):
    """Per-function resource records from nvcc --resource-usage / -Xptxas -v output, in order."""
    funcs, cur, arch = {}, None, default_arch

    def get(name):
        key = (name, arch)
        if key not in funcs:
            funcs[key] = Func(name, arch)
        return funcs[key]

    for line in text.splitlines():
        if m := ENTRY.search(line):
            arch = m.group(2).removeprefix("sm_")
            cur = get(m.group(1))
            cur.entry = True
        elif m := PROPS.search(line):
            cur = get(m.group(1))
        elif (m := FRAME.search(line)) and cur is not None:
            cur.stack, cur.spill_st, cur.spill_ld = (int(g) for g in m.groups())
        elif (m := USED.search(line)) and cur is not None:
            cur.regs = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                cur.smem = int(s.group(1))
            if s := re.search(r"(\d+) bytes lmem", line):
                cur.lmem = int(s.group(1))
    return list(funcs.values())


def judge(f, budget):
    """Problems with one function's resources (an empty list = pass)."""
    problems = []
    what = f"{f.name} on sm_{f.arch}"
    if f.stack is None or (f.entry and f.regs is None):
        return [f"{what}: could not parse ptxas's report for it (format changed?)"]
    if f.spill_st or f.spill_ld:
        problems.append(f"{what}: register spill: {f.spill_st} bytes spill stores, {f.spill_ld} bytes spill loads"
                        f" ({f.regs} registers) -- ptxas ran out of registers")
    allowed_stack = budget.stack if budget else 0
    if max(f.stack, f.lmem) > allowed_stack:
        why = "it holds the spills" if (f.spill_st or f.spill_ld) else \
            "no spills: a per-thread array indexed at run time, or a call, went to local memory"
        problems.append(f"{what}: {max(f.stack, f.lmem)} bytes stack frame (local memory) > {allowed_stack}"
                        f" allowed; {why}")
    if not f.entry:
        return problems  # a non-inlined __device__ function: spills and stack only
    if budget is None:
        problems.append(f"{what}: no register budget -- add \"{f.name}\" to BUDGETS in tests/cuda_resources.py")
    elif f.regs > budget.regs:
        (b, occ), (bb, occb) = occupancy(f.regs, budget.threads), occupancy(budget.regs, budget.threads)
        problems.append(f"{what}: {f.regs} registers/thread > budget {budget.regs} (at {budget.threads} threads/block:"
                        f" {b} blocks/SM, {occ:.1f}% occupancy; the budget allows {bb} blocks/SM, {occb:.1f}%)")
    return problems


def compile_one(nvcc, flags, source, arch, tmp):
    out = os.path.join(tmp, f"{os.path.basename(source)}.sm_{arch}.cubin")
    # -cubin: device code only (the host pass does not change ptxas's report and doubles the time).
    cmd = [nvcc, "-forward-unknown-to-host-compiler", *flags, "-x", "cu",
           f"--generate-code=arch=compute_{arch},code=sm_{arch}", "--resource-usage", "-cubin", source, "-o", out]
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return cmd, r.returncode, r.stdout


def self_test():
    """The parser and the verdicts on a canned spilling report (so a broken parse cannot pass)."""
    sample = ("ptxas info    : Compiling entry function '_ZN6relgen4cuda12_GLOBAL__N_115AttentionKernelEPKf' for "
              "'sm_90'\nptxas info    : Function properties for _ZN6relgen4cuda12_GLOBAL__N_115AttentionKernelEPKf\n"
              "    104 bytes stack frame, 236 bytes spill stores, 276 bytes spill loads\n"
              "ptxas info    : Used 24 registers, used 1 barriers, 128 bytes smem, 104 bytes cumulative stack size\n")
    (f,) = parse_ptxas(sample, "90")
    assert (f.name, f.arch, f.entry, f.regs, f.stack, f.spill_st, f.spill_ld, f.smem) == \
        ("AttentionKernel", "90", True, 24, 104, 236, 276, 128), vars(f)
    assert len(judge(f, Budget(128, 80))) == 2 and len(judge(f, None)) == 3  # spills, stack, [no budget]
    f.stack = f.spill_st = f.spill_ld = 0
    assert judge(f, Budget(128, 24)) == [] and len(judge(f, Budget(128, 16))) == 1  # registers only
    assert short_name("_Z9AddKernelPf") == "AddKernel" and short_name("plain") == "plain"
    assert occupancy(64, 128) == (8, 50.0) and occupancy(32, 256) == (8, 100.0) and occupancy(32, 64) == (32, 100.0)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", default=os.environ.get("CUDACXX") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else "nvcc"))
    ap.add_argument("--source-dir", default=os.path.dirname(here), help="repository root")
    ap.add_argument("--arch", action="append", help="sm number, repeatable (default: 80 and 90)")
    ap.add_argument("--flags", action="append",
                    help=f"the build's nvcc flags, shell-split, repeatable (default: {DEFAULT_FLAGS!r})")
    ap.add_argument("--include-dirs", default="", help="';'-separated include dirs (default: the source dir)")
    ap.add_argument("--defines", default="", help="';'-separated compile definitions")
    ap.add_argument("--sources", default="", help="';'-separated .cu files (default: kernels/cuda/*.cu)")
    ap.add_argument("--jobs", type=int, default=1, help="parallel nvcc runs (default 1)")
    ap.add_argument("--extra-flags", default=os.environ.get("RELGEN_CUDA_RESOURCES_EXTRA_FLAGS", ""),
                    help="TESTING ONLY, e.g. -maxrregcount=16 to force spills")
    ap.add_argument("--regs-cap", type=int, help="TESTING ONLY: cap every register budget at N")
    ap.add_argument("--verbose", action="store_true", help="print ptxas's raw report")
    args = ap.parse_args()
    try:
        self_test()
    except AssertionError as e:
        print(f"ERROR: the script's parser self-test failed: {e!r}")
        return 2

    src = os.path.abspath(args.source_dir)
    archs = args.arch or list(ARCHS)
    flags = [a for s in (args.flags or [DEFAULT_FLAGS]) for a in shlex.split(s)]
    incs = list(dict.fromkeys(d for d in args.include_dirs.split(";") if d)) or [src]
    flags += [f"-I{d}" for d in incs] + [f"-D{d}" for d in args.defines.split(";") if d]
    extra = shlex.split(args.extra_flags)
    sources = [s for s in args.sources.split(";") if s] or sorted(
        os.path.join(src, "kernels", "cuda", f) for f in os.listdir(os.path.join(src, "kernels", "cuda"))
        if f.endswith(".cu"))
    budgets = dict(BUDGETS)
    if extra or args.regs_cap:
        print(f"*** TEST MODE (not for CI): extra nvcc flags {extra}, register cap {args.regs_cap} ***")
    if args.regs_cap:
        budgets = {k: b._replace(regs=min(b.regs, args.regs_cap)) for k, b in budgets.items()}

    start = time.monotonic()
    jobs = [(s, a) for a in archs for s in sources]
    with tempfile.TemporaryDirectory(prefix="relgen-cuda-resources-") as tmp, \
            concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: compile_one(args.nvcc, flags + extra, j[0], j[1], tmp), jobs))
    elapsed = time.monotonic() - start

    funcs, errors = [], []
    for (source, arch), (cmd, rc, out) in zip(jobs, results):
        rel = os.path.relpath(source, src)
        if args.verbose or rc != 0:
            print(f"$ {shlex.join(cmd)}\n{out}")
        if rc != 0:
            errors.append(f"nvcc failed (exit {rc}) on {rel} for sm_{arch}")
            continue
        found = parse_ptxas(out, arch)
        if not found:
            errors.append(f"no ptxas resource report for {rel} on sm_{arch} (is --resource-usage honoured?)")
        for f in found:
            f.source = rel
        funcs += found
    if errors:
        print("\n".join(f"ERROR: {e}" for e in errors))
        return 2

    failures = []
    for arch in archs:
        mine = sorted((f for f in funcs if f.arch == arch), key=lambda f: (f.source, not f.entry, f.name))
        print(f"\nsm_{arch}: nvcc {shlex.join(flags + extra)}")
        hdr = ("kernel", "file", "thr", "regs", "budget", "blk/SM", "occ%", "occ%@bud", "smem", "stack",
               "spill st/ld", "verdict")
        rows = []
        for f in mine:
            b = budgets.get(f.name) if f.entry else None
            problems = judge(f, b)
            failures += problems
            blk, occ = occupancy(f.regs, b.threads) if (b and f.regs) else (None, None)
            rows.append((f.name if f.entry else f"{f.name} (device fn)", os.path.basename(f.source),
                         b.threads if b else "-", f.regs if f.regs is not None else "-", b.regs if b else "-",
                         blk if blk is not None else "-", f"{occ:.1f}" if occ is not None else "-",
                         f"{occupancy(b.regs, b.threads)[1]:.1f}" if b else "-", f.smem, f.stack,
                         f"{f.spill_st}/{f.spill_ld}", "FAIL" if problems else "ok"))
        for name in budgets:
            if not any(f.entry and f.name == name for f in mine):
                failures.append(f"{name} on sm_{arch}: in BUDGETS but not compiled (renamed or removed? update "
                                f"tests/cuda_resources.py)")
        widths = [max(len(str(r[i])) for r in [hdr] + rows) for i in range(len(hdr))]
        for r in [hdr] + rows:
            print("  " + "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                                   for i, (c, w) in enumerate(zip(r, widths))))
    print("\n(thr: block size at launch; blk/SM, occ%: resident blocks and warp occupancy per SM that the registers"
          " allow; occ%@bud: the same at the budget; smem: static shared bytes; stack: stack frame bytes)")
    print(f"{len(jobs)} nvcc runs ({len(sources)} files x {len(archs)} archs, {max(1, args.jobs)} at a time) in "
          f"{elapsed:.1f} s")
    if failures:
        print(f"\nFAIL: {len(failures)} CUDA resource budget violation(s):")
        print("\n".join(f"  - {p}" for p in failures))
        print("Budgets and their occupancy reasoning: BUDGETS at the top of tests/cuda_resources.py.")
        return 1
    print("PASS: no spills, no local memory, every kernel within its register budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
