"""The pip-installed Python client against a live relgen-server (run by CTest with the venv's
python; RELGEN_SERVER_BIN and RELGEN_GOLDEN_DIR set)."""
import os
import re
import subprocess
import sys
import unittest
import urllib.request

import relgen_client
from relgen_client import Client, RelgenError

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        assert not relgen_client.__file__.startswith(os.path.join(SOURCE, "client")), "not the installed package"
        model = os.path.join(os.environ["RELGEN_GOLDEN_DIR"], "engine", "skew")
        cls.server = subprocess.Popen(
            [os.environ["RELGEN_SERVER_BIN"], "--model", model, "--listen", "127.0.0.1:0", "--metrics_listen",
             "127.0.0.1:0", "--http_listen", "127.0.0.1:0", "--kv_cache_tokens", "8192", "--enable_test_hooks"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in cls.server.stdout:
            m = re.search(r"gRPC on (127\.0\.0\.1:\d+).*metrics on (127\.0\.0\.1:\d+)", line)
            if m:
                cls.address, cls.admin = m.group(1), m.group(2)
                break
        else:
            raise RuntimeError("relgen-server did not start")

    @classmethod
    def tearDownClass(cls):
        cls.server.terminate()
        cls.server.wait(timeout=30)

    def hook(self, name):
        with urllib.request.urlopen(urllib.request.Request(f"http://{self.admin}/testing/{name}", method="POST"),
                                    timeout=120) as r:
            self.assertEqual(r.status, 200)

    def test_generate_and_stream_agree(self):
        with Client(self.address, timeout=30) as c:
            done = c.generate([10, 20, 30], max_new_tokens=25, temperature=0, ignore_eos=True, logprobs=1)
            self.assertEqual(done.finish_reason, "length")
            self.assertEqual(done.generated_tokens, 25)
            self.assertEqual(len(done.token_ids), 25)
            self.assertEqual(len(done.logprobs), 25)
            self.assertEqual(done.logprobs[0].token_id, done.logprobs[0].top[0].token_id)
            # The engine is let through one step before the stream's first chunk, so that chunk holds
            # one token and comes while the request runs, however fast or slow the machine is.
            self.hook("pause")
            try:
                self.hook("step")
                stream = c.stream([10, 20, 30], max_new_tokens=25, temperature=0, ignore_eos=True)
                first = next(stream)
            finally:
                self.hook("resume")
            self.assertEqual(len(first.token_ids), 1)
            self.assertIsNone(first.finish_reason)
            chunks = [first] + list(stream)
            self.assertEqual([t for ch in chunks for t in ch.token_ids], done.token_ids)
            self.assertEqual("".join(ch.text for ch in chunks), done.text)
            self.assertEqual(chunks[-1].finish_reason, "length")
            self.assertEqual(chunks[-1].prompt_tokens, 3)

    def test_seeded_sampling_repeats(self):
        with Client(self.address) as c:
            a = c.generate("relgen", max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
            b = c.generate("relgen", max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
            self.assertEqual(a.token_ids, b.token_ids)

    def test_errors_carry_the_status(self):
        with Client(self.address) as c:
            with self.assertRaises(RelgenError) as e:
                c.generate("x", top_p=1.5)
            self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
            self.assertIn("top_p", e.exception.details)
        with self.assertRaises(RelgenError) as e:
            Client("127.0.0.1:1", timeout=3).generate("x")
        self.assertEqual(e.exception.code, "UNAVAILABLE")

    def test_samples_match_their_seeds(self):
        with Client(self.address, timeout=30) as c:
            done = c.generate([10, 20, 30], max_new_tokens=12, temperature=1.0, seed=21, ignore_eos=True, n=3)
            self.assertEqual([s.index for s in done.samples], [0, 1, 2])
            self.assertEqual(done.generated_tokens, 36)
            self.assertEqual(done.token_ids, done.samples[0].token_ids)
            for s in done.samples:
                alone = c.generate([10, 20, 30], max_new_tokens=12, temperature=1.0, seed=21 + s.index, ignore_eos=True)
                self.assertEqual(s.token_ids, alone.token_ids, s.index)
                self.assertEqual(s.text, alone.text, s.index)
                self.assertEqual(s.finish_reason, "length")
                self.assertEqual(len(alone.samples), 1)
                self.assertEqual(alone.samples[0].token_ids, alone.token_ids)
            chunks = list(c.stream([10, 20, 30], max_new_tokens=12, temperature=1.0, seed=21, ignore_eos=True, n=3))
            for s in done.samples:
                mine = [ch for ch in chunks if ch.sample_index == s.index]
                self.assertEqual([t for ch in mine for t in ch.token_ids], s.token_ids)
                self.assertEqual([ch.finish_reason for ch in mine if ch.finish_reason], ["length"])
                self.assertEqual(mine[-1].finish_reason, "length")

    def test_score_equals_prompt_logprobs(self):
        with Client(self.address, timeout=30) as c:
            context, continuations = [10, 20, 30, 40], [[50, 60, 70], [7]]
            result = c.score(context, continuations, top_logprobs=2)
            self.assertEqual(result.prompt_tokens, 4)
            self.assertEqual(result.continuation_tokens, 4)
            for cont, scored in zip(continuations, result.scores):
                self.assertEqual(scored.token_ids, cont)
                done = c.generate(context + cont, max_new_tokens=1, prompt_logprobs=2)
                self.assertEqual(len(done.prompt_logprobs), len(context) + len(cont) - 1)
                want = done.prompt_logprobs[len(context) - 1:]
                self.assertEqual([t.token_id for t in scored.logprobs], cont)
                for got, ref in zip(scored.logprobs, want):
                    self.assertEqual(got.token_id, ref.token_id)
                    self.assertAlmostEqual(got.logprob, ref.logprob, delta=1e-5)
                    self.assertEqual([a.token_id for a in got.top], [a.token_id for a in ref.top])
                self.assertAlmostEqual(scored.sum_logprob, sum(t.logprob for t in scored.logprobs), delta=1e-9)
            text = c.score("Hello", [" world"])
            self.assertEqual(text.prompt_tokens, 6)  # BOS + 5 bytes
            self.assertEqual(text.scores[0].token_ids, list(b" world"))

    def test_new_fields_are_validated(self):
        with Client(self.address) as c:
            for call, field in ((lambda: c.generate("x", n=17), "n: 17"),
                                (lambda: c.generate("x", prompt_logprobs=21), "prompt_logprobs: 21"),
                                (lambda: c.score("x", [""]), "continuations: continuations[0] is empty"),
                                (lambda: c.score("x", ["a"] * 65), "continuations: 65 continuations"),
                                (lambda: c.score("x", ["a"], top_logprobs=21), "top_logprobs: 21")):
                with self.assertRaises(RelgenError) as e:
                    call()
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn(field, e.exception.details)

    def test_info(self):
        with Client(self.address) as c:
            info = c.info()
        self.assertEqual(info["name"], "engine-skew")
        self.assertEqual(info["relative_attention"]["scheme"], "skew")

    def test_example_runs(self):
        out = subprocess.run([sys.executable, os.path.join(SOURCE, "client", "python", "examples", "generate.py"),
                              "--server", self.address, "--max-new-tokens", "8", "hello"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        self.assertIn("model: engine-skew", out)
        self.assertIn("error: INVALID_ARGUMENT - temperature", out)


if __name__ == "__main__":
    unittest.main(verbosity=2)
