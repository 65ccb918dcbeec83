#!/usr/bin/env python3
"""tools/check_includes.py seen failing: on a copy of the tree, each rule is broken once by a planted
include, and the check must exit 1 naming the planted file, its line and the rule; the untouched
copy passes, so the plant is what failed. A temporary exception that matches nothing fails too.

Plants go into new files in the folders a rule guards, so the test does not depend on which files
exist there today.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "check_includes.py")

spec = importlib.util.spec_from_file_location("check_includes", SCRIPT)
check_includes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_includes)

# (new file, include as written, rule it breaks): one per rule, both directions where a rule has two.
PLANTS = [
    ("kernels/cpu/planted.cc", '#include "kernels/cuda/launch.h"', "kernels-cpu-cuda"),
    ("kernels/cuda/planted.cu", '#include "kernels/cpu/ops.h"', "kernels-cpu-cuda"),
    ("kernels/planted.h", '#include "engine/model/config.h"', "kernels-at-the-bottom"),
    ("engine/model/planted.h", '#include "kernels/cpu/ops.h"', "model-neutral-kernels"),
    ("engine/model/planted.cc", '#include "engine/backends/backend.h"', "model-below-backends"),
    ("engine/backends/planted.cc", '#include "engine/core/engine.h"', "backends-not-core"),
    ("engine/core/planted.cc", '#include "engine/backends/cpu_backend.h"', "core-speaks-to-backend"),
    ("engine/core/planted.h", '#include "engine/backends/cuda/graphs.h"', "core-speaks-to-backend"),
    ("engine/core/planted_kernels.cc", '#include "kernels/cpu/gemm.h"', "core-speaks-to-backend"),
    ("engine/backends/cuda/planted.cc", '#include "kernels/cpu/bf16.h"', "cuda-backend-cpu-kernels"),
    ("engine/backends/cpu_planted.cc", '#include "kernels/cuda/decoder_kernels.h"', "cpu-backend-cuda-kernels"),
    ("engine/core/planted_wire.cc", "#include <grpcpp/grpcpp.h>", "engine-knows-no-wire"),
    ("engine/tokenizers/planted.cc", '#include "relgen/v1/generation.pb.h"', "engine-knows-no-wire"),
    ("server/planted.cc", '#include "kernels/cpu/gemm.h"', "server-not-kernels"),
    ("server/openai_api_planted.cc", '#include "server/service.h"', "http-grpc-apart"),
    ("server/service_planted.cc", '#include "server/openai_api.h"', "http-grpc-apart"),
    ("client/planted.cc", '#include "engine/core/engine.h"', "client-proto-only"),
]
PLANT_LINE = 3  # the include's line in the planted file


def copy_tree(dst):
    for top in check_includes.CHECKED:
        shutil.copytree(os.path.join(ROOT, top), os.path.join(dst, top),
                        ignore=shutil.ignore_patterns("python", "__pycache__"))


def run_check(root):
    p = subprocess.run([sys.executable, SCRIPT, "--root", root], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


class CheckIncludesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="check_includes_test.")
        copy_tree(cls.tmp)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_the_tree_passes(self):
        rc, out = run_check(self.tmp)
        self.assertEqual(rc, 0, out)

    def test_every_rule_is_planted(self):
        self.assertEqual({r.name for r in check_includes.RULES}, {rule for _, _, rule in PLANTS})

    def test_each_planted_include_fails_naming_file_line_and_rule(self):
        for path, include, rule in PLANTS:
            with self.subTest(path=path):
                full = os.path.join(self.tmp, path)
                os.makedirs(os.path.dirname(full), exist_ok=True)
                with open(full, "w") as f:
                    f.write("// planted by tests/check_includes_test.py\n#pragma once\n" + include + "\n")
                try:
                    rc, out = run_check(self.tmp)
                finally:
                    os.remove(full)
                self.assertEqual(rc, 1, out)
                self.assertIn(f"{path}:{PLANT_LINE}: [{rule}] {include}", out)
                self.assertEqual(sum(1 for line in out.splitlines() if line.startswith(path + ":")), 1, out)

    def test_an_include_written_beside_its_file_is_resolved(self):
        # An include spelled relative to its file is read as the file it names, so a relative
        # spelling cannot hide an arrow.
        full = os.path.join(self.tmp, "kernels/cuda/planted_relative.cu")
        with open(full, "w") as f:
            f.write("// planted\n#pragma once\n#include \"../cpu/ops.h\"\n")
        try:
            rc, out = run_check(self.tmp)
        finally:
            os.remove(full)
        self.assertEqual(rc, 1, out)
        self.assertIn('kernels/cuda/planted_relative.cu:3: [kernels-cpu-cuda] #include "../cpu/ops.h"', out)

    def test_an_exception_that_matches_nothing_fails(self):
        exceptions = dict(check_includes.EXCEPTIONS)
        exceptions[("server/main.cc", "kernels/cpu/gemm.h", "server-not-kernels")] = "fixed long ago"
        violations, stale, _ = check_includes.check(self.tmp, exceptions=exceptions)
        self.assertEqual(violations, [])
        self.assertEqual(len(stale), 1, stale)
        self.assertIn("server/main.cc: [server-not-kernels] the exception for kernels/cpu/gemm.h", stale[0])

    def test_an_exception_excuses_only_its_own_include(self):
        violations, _, _ = check_includes.check(self.tmp, exceptions={})
        self.assertEqual(sorted({v.split(":")[0] for v in violations}),
                         sorted({src for src, _, _ in check_includes.EXCEPTIONS}))


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + ["-v"])
