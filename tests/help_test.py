#!/usr/bin/env python3
"""--help on every shipped binary: exit 0, the help on stdout, every flag and command listed.

The expected flags are read from the sources that define them (ABSL_FLAG in server/main.cc, the
flag tables in client/request_flags.cc, the commands relgen-bench dispatches on), so a flag added
without showing in --help fails here. Usage errors keep their non-zero status.
"""
import os
import re
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(binary, *args):
    p = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr


def source(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


class HelpTest(unittest.TestCase):
    def assert_lists(self, out, names, what):
        missing = [n for n in names if n not in out]
        self.assertFalse(missing, f"{what} missing from --help: {missing}\n{out}")

    def test_server(self):
        binary = os.environ["RELGEN_SERVER_BIN"]
        flags = re.findall(r"ABSL_FLAG\(\s*[\w:]+\s*,\s*(\w+)\s*,", source("server/main.cc"))
        self.assertIn("model", flags)
        self.assertIn("listen", flags)
        self.assertGreater(len(flags), 30)
        for args in (["--help"], ["-h"], ["--helpshort"], ["--model", "/nonexistent", "--help"]):
            rc, out, err = run(binary, *args)
            self.assertEqual(rc, 0, f"{args}: {err}")
            self.assertNotIn("No flags matched", out + err)
            self.assert_lists(out, [f"\n  --{f} (default " for f in flags], f"{args}: flags of server/main.cc")
        # Each flag's help and default are shown, not just its name.
        self.assertIn('--listen (default "0.0.0.0:50051")', out)
        self.assertIn("--max_num_seqs (default 64)", out)
        self.assertIn("sequences in the running batch at most", out)
        # A flag absl does not know is still an error.
        rc, _, err = run(binary, "--no_such_flag=1")
        self.assertNotEqual(rc, 0)
        self.assertIn("no_such_flag", err)

    def test_client(self):
        binary = os.environ["RELGEN_CLIENT_BIN"]
        flags = re.findall(r'\{"(--\w+)", "\w+", "', source("client/request_flags.cc"))
        self.assertIn("--max_new_tokens", flags)
        self.assertIn("--continuation", flags)
        commands = ["relgen-client generate", "relgen-client score", "relgen-client info", "relgen-client health"]
        for args in (["--help"], ["-h"], ["help"], ["generate", "--help"], ["score", "--help"]):
            rc, out, err = run(binary, *args)
            self.assertEqual(rc, 0, f"{args}: {err}")
            self.assertEqual(err, "", args)
            self.assert_lists(out, commands + flags + ["--server", "--tls_ca", "--timeout", "--stream", "--json"],
                              f"{args}: commands and flags")
        rc, _, err = run(binary, "make")
        self.assertEqual(rc, 64)
        self.assertIn("unknown command 'make'", err)

    def test_bench(self):
        binary = os.environ["RELGEN_BENCH_BIN"]
        commands = re.findall(r'cmd == "(\w+)"', source("tools/bench/relgen_bench.cc"))
        commands = [c for c in commands if c != "help"]
        self.assertIn("serve", commands)
        self.assertGreaterEqual(len(commands), 7)
        for args in (["--help"], ["-h"], ["help"], ["serve", "--help"], ["engine", "--model", "x", "--help"]):
            rc, out, err = run(binary, *args)
            self.assertEqual(rc, 0, f"{args}: {err}")
            self.assert_lists(out, [f"relgen-bench {c} " for c in commands] + ["--model", "--server", "--json"],
                              f"{args}: commands")
        rc, _, err = run(binary, "nope")
        self.assertEqual(rc, 64)
        self.assertIn("usage: relgen-bench", err)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + ["-v"])
