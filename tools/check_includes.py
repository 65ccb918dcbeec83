#!/usr/bin/env python3
"""The include boundaries of docs/architecture.md, checked on every #include in the tree.

Reads each C++ / CUDA source under the checked folders and fails (exit 1), naming file:line and the
rule, on an include that crosses a layer the wrong way. A temporary exception must be named here
with the reason it exists; one that no longer matches anything fails the check too, so it is
removed once the code it excused is fixed. tests/ and tools/ may include anything and are not read.

  python3 tools/check_includes.py [--root DIR]
"""
import argparse
import os
import re
import sys
from dataclasses import dataclass

CHECKED = ("kernels", "engine", "server", "client")
SOURCE_SUFFIXES = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')


@dataclass(frozen=True)
class Rule:
    name: str
    source: str      # regex on the including file's path (from the root)
    forbidden: str   # regex on the included path (from the root, as the build's include path spells it)
    why: str


# The two APIs' own files: the OpenAI HTTP API and the gRPC service, and any file split from them.
HTTP_FILES = r"^server/openai[^/]*$"
GRPC_FILES = r"^server/(service|grpc)[^/]*$"

RULES = (
    Rule("kernels-cpu-cuda", r"^kernels/cpu/", r"^kernels/cuda/",
         "kernels/cpu and kernels/cuda never include each other; what both need lives at kernels/*.h"),
    Rule("kernels-cpu-cuda", r"^kernels/cuda/", r"^kernels/cpu/",
         "kernels/cpu and kernels/cuda never include each other; what both need lives at kernels/*.h"),
    Rule("kernels-at-the-bottom", r"^kernels/", r"^(engine|server|client|tools|tests)/|^relgen/v1/|^grpc",
         "kernels include nothing of the layers above them"),
    Rule("model-neutral-kernels", r"^engine/model/", r"^kernels/[^/]+/",
         "engine/model includes only the device-neutral kernels headers (kernels/*.h)"),
    Rule("model-below-backends", r"^engine/model/", r"^engine/(core|backends)/",
         "engine/model is below the backends and the engine core"),
    Rule("backends-not-core", r"^engine/backends/", r"^engine/core/",
         "engine/backends never includes engine/core: what the two share belongs with the Backend interface"),
    Rule("core-speaks-to-backend", r"^engine/core/",
         r"^engine/backends/(cpu_backend|cuda_backend|device)\.h$|^engine/backends/(cpu|cuda)/|^kernels/(cpu|cuda)/",
         "engine/core speaks to the Backend interface (backend.h and its types), never to one backend, "
         "the device choice or a device's kernels"),
    Rule("cuda-backend-cpu-kernels", r"^engine/backends/(cuda_|cuda/)", r"^kernels/cpu/",
         "the CUDA backend includes kernels/cuda and the device-neutral kernels/*.h, not the CPU kernels"),
    Rule("cpu-backend-cuda-kernels", r"^engine/backends/(cpu_|cpu/)", r"^kernels/cuda/",
         "the CPU backend includes kernels/cpu and the device-neutral kernels/*.h, not the CUDA kernels"),
    Rule("engine-knows-no-wire", r"^engine/", r"^(server|client)/|^relgen/v1/|^grpc",
         "the engine knows no wire: no server, client, proto or gRPC headers"),
    Rule("server-not-kernels", r"^server/", r"^kernels/",
         "server never includes kernels/: it reaches the model through engine/"),
    Rule("http-grpc-apart", HTTP_FILES, GRPC_FILES,
         "the HTTP API (openai_api.*) and the gRPC service (service.*) never include each other; "
         "what both use has a home of its own"),
    Rule("http-grpc-apart", GRPC_FILES, HTTP_FILES,
         "the HTTP API (openai_api.*) and the gRPC service (service.*) never include each other; "
         "what both use has a home of its own"),
    Rule("client-proto-only", r"^client/", r"^(engine|server|kernels)/",
         "the client speaks the wire contract (proto) only"),
)

# Temporary exceptions: (including file, included path, rule) and why. Each is code another change
# is moving; the check fails once an exception matches nothing, so the entry goes with the fix.
EXCEPTIONS = {}


@dataclass(frozen=True)
class Include:
    path: str     # the including file, from the root
    line: int
    target: str   # the included path, from the root where it resolves there
    text: str     # as written


def _resolve(root, src, target, quoted):
    """Root-relative path of a quoted include written relative to its file; else as written."""
    if quoted and not os.path.exists(os.path.join(root, target)):
        beside = os.path.normpath(os.path.join(os.path.dirname(src), target))
        if os.path.exists(os.path.join(root, beside)):
            return beside.replace(os.sep, "/")
    return target


def read_includes(root):
    includes = []
    for top in CHECKED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                full = os.path.join(dirpath, name)
                src = os.path.relpath(full, root).replace(os.sep, "/")
                with open(full, encoding="utf-8", errors="replace") as f:
                    for n, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if m:
                            target = _resolve(root, src, m.group(2), m.group(1) == '"')
                            includes.append(Include(src, n, target, line.strip()))
    return includes


def check(root, rules=RULES, exceptions=EXCEPTIONS):
    """Returns (violations, stale exceptions): lines to print, empty when the tree keeps its bounds."""
    violations, used = [], set()
    includes = read_includes(root)
    for inc in includes:
        for rule in rules:
            if not (re.search(rule.source, inc.path) and re.search(rule.forbidden, inc.target)):
                continue
            key = (inc.path, inc.target, rule.name)
            if key in exceptions:
                used.add(key)
                continue
            violations.append(f"{inc.path}:{inc.line}: [{rule.name}] {inc.text}: {rule.why}")
    stale = [f"{src}: [{rule}] the exception for {target} matches no include any more: remove it from "
             f"tools/check_includes.py" for (src, target, rule) in sorted(set(exceptions) - used)]
    return violations, stale, len(includes)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the source tree (default: this script's)")
    args = parser.parse_args()
    violations, stale, count = check(args.root)
    for line in violations + stale:
        print(line)
    if violations or stale:
        print(f"check_includes: {len(violations)} forbidden include(s), {len(stale)} stale exception(s) "
              f"(docs/architecture.md gives the layers and their arrows)", file=sys.stderr)
        return 1
    print(f"check_includes: {count} includes within bounds ({len(EXCEPTIONS)} temporary exceptions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
