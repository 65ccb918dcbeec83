"""The OpenAI-compatible HTTP API (--http_listen) driven by the official `openai` client, checked
against the gRPC API of the same server through the repository's Python client (run by CTest with
the build-hf-venv python, which has openai and httpx; RELGEN_SERVER_BIN and RELGEN_GOLDEN_DIR set).

Every request is deterministic (greedy, or seeded sampling) and ignore_eos fixes the lengths, so a
completion must equal gRPC's Generate for the same parameters: the text, the number of tokens and
their log-probabilities."""
import atexit
import gzip
import http.client
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _grpc_stubs():
    """relgen.v1's Python stubs, generated from proto/ into a temporary folder (as client/python's
    setup.py does when it builds the package: no generated code is committed)."""
    out = tempfile.mkdtemp(prefix="relgen-stubs-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    proto_root = os.path.join(SOURCE, "proto")
    proto = os.path.join(proto_root, "relgen", "v1", "generation.proto")
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        cmd = [protoc, f"-I{proto_root}", f"--python_out={out}", f"--grpc_out={out}",
               f"--plugin=protoc-gen-grpc={plugin}", proto]
    else:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_root}", f"--python_out={out}",
               f"--grpc_python_out={out}", proto]
    subprocess.run(cmd, check=True)
    for pkg in ("relgen", os.path.join("relgen", "v1")):
        open(os.path.join(out, pkg, "__init__.py"), "a").close()
    return out


# The repository's gRPC client from the source tree (over Debian's grpcio and protobuf, which the
# venv sees through its system site-packages), with freshly generated stubs.
sys.path.insert(0, os.path.join(SOURCE, "client", "python"))
sys.path.insert(1, _grpc_stubs())

import httpx  # noqa: E402
import openai  # noqa: E402
import relgen_client  # noqa: E402

TOLERANCE = 1e-6  # gRPC's log-probabilities are float32; the HTTP API's JSON numbers must match them
STARTUP_GIVE_UP_S = 120  # a bound for a failing start only: a good one prints its line in a second


class Server:
    """A relgen-server on loopback ports of its own choosing, serving gRPC, HTTP and metrics."""

    def __init__(self, *flags, model=None):
        binary = os.environ["RELGEN_SERVER_BIN"]
        model = model or os.path.join(os.environ["RELGEN_GOLDEN_DIR"], "engine", "skew")
        # A missing fixture is a failure, not a skip.
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"RELGEN_SERVER_BIN {binary} is not an executable")
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise RuntimeError(f"no model at {model}")
        self.proc = subprocess.Popen(
            [binary, "--model", model, "--listen", "127.0.0.1:0", "--metrics_listen", "127.0.0.1:0",
             "--http_listen", "127.0.0.1:0", "--kv_cache_tokens", "8192", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        # Its output is read on a thread for as long as it runs, so it never blocks on a full pipe.
        self.output = []
        lines = queue.Queue()

        def pump():
            for line in self.proc.stdout:
                self.output.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + STARTUP_GIVE_UP_S
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"relgen-server printed no startup line in {STARTUP_GIVE_UP_S} s:\n{self.log()}")
            if line is None:
                raise RuntimeError(f"relgen-server exited with {self.proc.wait()} before serving:\n{self.log()}")
            if "gRPC on" in line:
                break
        addresses = {}
        for name, what in (("grpc", "gRPC"), ("http", "HTTP"), ("metrics", "metrics")):
            m = re.search(what + r" on (127\.0\.0\.1:\d+)", line)
            if not m:
                self.stop()
                raise RuntimeError(f"the startup line names no {what} address: {line!r}")
            addresses[name] = m.group(1)
        self.grpc, self.http, self.metrics = addresses["grpc"], addresses["http"], addresses["metrics"]
        self.base_url = f"http://{self.http}/v1"

    def log(self):
        return "".join(self.output)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def openai_client(server, api_key="unused"):
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=60)


def grpc_samples(completion):
    """Every sample of a relgen_client Completion (n = 1 included), in index order."""
    return sorted(completion.samples, key=lambda s: s.index)


class OpenAIApiTestCase(unittest.TestCase):
    """Assertions shared by the suites."""

    def assert_error(self, raised, status, type_=None, param=None, names=()):
        """An openai.APIStatusError with the API's error envelope."""
        e = raised.exception
        self.assertEqual(e.status_code, status, e)
        body = e.response.json()
        self.assertIn("error", body, body)
        error = body["error"]
        for key in ("message", "type", "param", "code"):
            self.assertIn(key, error, body)
        self.assertIsInstance(error["message"], str)
        if type_ is not None:
            self.assertEqual(error["type"], type_, body)
        if param is not None:
            self.assertEqual(error["param"], param, body)
        for name in names:
            self.assertIn(name, error["message"], body)
        return error

    def assert_raw_error(self, response, status, type_=None):
        """A raw httpx response carrying the API's error envelope."""
        self.assertEqual(response.status_code, status, response.text)
        error = response.json()["error"]
        for key in ("message", "type", "param", "code"):
            self.assertIn(key, error, response.text)
        if type_ is not None:
            self.assertEqual(error["type"], type_, response.text)
        return error

    def assert_top_logprobs(self, top, infos, n):
        """A top_logprobs dict (token text -> logprob) against gRPC's alternatives at that position:
        at most n entries, each one of gRPC's; a printable ASCII byte's text is its character."""
        self.assertIsInstance(top, dict)
        self.assertLessEqual(len(top), n, top)
        if n > 0:
            self.assertGreaterEqual(len(top), 1, top)
        grpc_values = [a.logprob for a in infos]
        for text, value in top.items():
            self.assertTrue(any(abs(value - g) <= TOLERANCE for g in grpc_values), (text, value, grpc_values))
        for a in infos:
            if 32 <= a.token_id < 127 and chr(a.token_id) in top:
                self.assertAlmostEqual(top[chr(a.token_id)], a.logprob, delta=TOLERANCE)

    def assert_token_logprobs(self, tokens, token_logprobs, top_logprobs, infos, n):
        """Per-token entries of an HTTP logprobs object against gRPC's TokenInfo list."""
        self.assertEqual(len(tokens), len(infos))
        self.assertEqual(len(token_logprobs), len(infos))
        self.assertEqual(len(top_logprobs), len(infos))
        for token, logprob, top, info in zip(tokens, token_logprobs, top_logprobs, infos):
            self.assertIsInstance(token, str)
            if 32 <= info.token_id < 127:
                # A generated token's string is the text it added: its character, after the U+FFFD
                # of an incomplete character before it, which the byte tokenizer releases with it.
                self.assertEqual(token.lstrip("\ufffd"), chr(info.token_id))
            self.assertAlmostEqual(logprob, info.logprob, delta=TOLERANCE)
            self.assert_top_logprobs(top, info.top, n)

    def assert_tokens_at_offsets(self, logprobs, text):
        """Generated tokens only (no echo, no stop string): each token's string is the text at its
        text_offset, and the strings concatenate to the text."""
        for i, (token, offset) in enumerate(zip(logprobs.tokens, logprobs.text_offset)):
            self.assertEqual(text[offset:offset + len(token)], token, (i, logprobs))
        self.assertEqual("".join(logprobs.tokens), text)

    def assert_text_offsets(self, offsets, text, first):
        self.assertEqual(offsets[0], first)
        self.assertEqual(offsets, sorted(offsets), "text_offset decreases")
        self.assertLessEqual(offsets[-1], len(text))


class CompletionsTest(OpenAIApiTestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server()
        cls.client = openai_client(cls.server)
        cls.grpc = relgen_client.Client(cls.server.grpc, timeout=60)
        cls.http = httpx.Client(base_url=f"http://{cls.server.http}", timeout=60)
        cls.model = cls.client.models.list().data[0].id

    @classmethod
    def tearDownClass(cls):
        cls.http.close()
        cls.grpc.close()
        cls.client.close()
        cls.server.stop()

    def complete(self, prompt, **params):
        """A completion with ignore_eos (lengths fixed by max_tokens) unless params say otherwise."""
        extra = {"ignore_eos": True, **params.pop("extra_body", {})}
        return self.client.completions.create(model=self.model, prompt=prompt, extra_body=extra, **params)

    def stream(self, prompt, **params):
        """The streamed chunks of complete(prompt, stream=True, ...), as a list."""
        with self.complete(prompt, stream=True, **params) as chunks:
            return list(chunks)

    def assert_stream_equals(self, chunks, unary, include_usage=True):
        """A completion's stream against its unary answer: per choice index, the deltas concatenate
        to the text, the logprobs lists to the unary ones, and only the last chunk finishes."""
        if include_usage:
            last = chunks.pop()
            self.assertEqual(last.choices, [])
            self.assertEqual(last.usage.prompt_tokens, unary.usage.prompt_tokens)
            self.assertEqual(last.usage.completion_tokens, unary.usage.completion_tokens)
            self.assertEqual(last.usage.total_tokens, unary.usage.total_tokens)
        self.assertTrue(chunks)
        by_index = {}
        for chunk in chunks:
            self.assertEqual(chunk.object, "text_completion")
            self.assertEqual(chunk.model, self.model)
            self.assertIsNone(chunk.usage)
            self.assertEqual(len(chunk.choices), 1, chunk)
            by_index.setdefault(chunk.choices[0].index, []).append(chunk.choices[0])
        self.assertEqual(sorted(by_index), [c.index for c in unary.choices])
        for want in unary.choices:
            mine = by_index[want.index]
            self.assertEqual("".join(c.text for c in mine), want.text, want.index)
            self.assertEqual([c.finish_reason for c in mine[:-1]], [None] * (len(mine) - 1), want.index)
            self.assertEqual(mine[-1].finish_reason, want.finish_reason, want.index)
            if want.logprobs is not None:
                parts = [c.logprobs for c in mine if c.logprobs is not None]
                self.assertEqual([t for p in parts for t in p.tokens], want.logprobs.tokens)
                got = [v for p in parts for v in p.token_logprobs]
                self.assertEqual(len(got), len(want.logprobs.token_logprobs))
                for a, b in zip(got, want.logprobs.token_logprobs):
                    self.assertAlmostEqual(a, b, delta=TOLERANCE)

    def sorted_choices(self, completion):
        choices = sorted(completion.choices, key=lambda c: c.index)
        self.assertEqual([c.index for c in choices], list(range(len(choices))))
        return choices

    # --- models -----------------------------------------------------------------------------------

    def test_models_lists_the_served_model(self):
        info = self.grpc.info()
        listed = self.client.models.list().data
        self.assertEqual([m.id for m in listed], [info["name"]])
        body = self.http.get("/v1/models").json()
        self.assertEqual(body["object"], "list")
        self.assertEqual(len(body["data"]), 1)
        entry = body["data"][0]
        self.assertEqual(entry["id"], info["name"])
        self.assertEqual(entry["object"], "model")
        self.assertEqual(entry["owned_by"], "relgen")
        self.assertIsInstance(entry["created"], int)
        self.assertEqual(entry["max_model_len"], info["max_seq_len"])

    # --- completions against gRPC -----------------------------------------------------------------

    def test_unary_equals_grpc(self):
        for prompt in ("relgen", [10, 20, 30]):
            with self.subTest(prompt=prompt):
                r = self.complete(prompt, max_tokens=20, temperature=0, logprobs=3, user="openai-api-test")
                g = self.grpc.generate(prompt, max_new_tokens=20, temperature=0, logprobs=3, ignore_eos=True)
                self.assertTrue(r.id.startswith("cmpl-"), r.id)
                self.assertEqual(r.object, "text_completion")
                self.assertEqual(r.model, self.model)
                self.assertIsInstance(r.created, int)
                self.assertEqual(len(r.choices), 1)
                choice = r.choices[0]
                self.assertEqual(choice.index, 0)
                self.assertEqual(choice.text, g.text)
                self.assertEqual(choice.finish_reason, "length")
                self.assertEqual(len(choice.logprobs.tokens), g.generated_tokens)
                self.assert_token_logprobs(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                           choice.logprobs.top_logprobs, g.logprobs, 3)
                self.assertEqual(len(choice.logprobs.text_offset), 20)
                self.assert_text_offsets(choice.logprobs.text_offset, choice.text, 0)
                self.assert_tokens_at_offsets(choice.logprobs, choice.text)
                self.assertEqual(r.usage.prompt_tokens, g.prompt_tokens)
                self.assertEqual(r.usage.completion_tokens, 20)
                self.assertEqual(r.usage.total_tokens, g.prompt_tokens + 20)

    def test_streaming_equals_unary(self):
        for prompt in ("relgen", [10, 20, 30]):
            with self.subTest(prompt=prompt):
                unary = self.complete(prompt, max_tokens=24, temperature=0, logprobs=2)
                chunks = self.stream(prompt, max_tokens=24, temperature=0, logprobs=2,
                                     stream_options={"include_usage": True})
                # Text chunks, then the usage chunk. How many text chunks depends on how far the
                # engine runs ahead of the writer (it may deliver every token before the first write).
                self.assertGreaterEqual(len(chunks), 2)
                self.assert_stream_equals(chunks, unary)
                plain = self.stream(prompt, max_tokens=24, temperature=0)
                self.assert_stream_equals(plain, self.complete(prompt, max_tokens=24, temperature=0),
                                          include_usage=False)

    def test_stream_is_server_sent_events(self):
        request = {"model": self.model, "prompt": "relgen", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}}
        with self.http.stream("POST", "/v1/completions", json=request) as response:
            self.assertEqual(response.status_code, 200)
            self.assertTrue(response.headers["content-type"].startswith("text/event-stream"),
                            response.headers["content-type"])
            events = [line for line in response.iter_lines() if line]
        self.assertTrue(all(line.startswith("data: ") for line in events), events)
        self.assertEqual(events[-1], "data: [DONE]")
        chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
        self.assertTrue(all(c["object"] == "text_completion" for c in chunks), chunks)
        self.assertEqual(chunks[-1]["choices"], [])
        self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 8)
        self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "length")

    def test_no_chunk_follows_the_last_token(self):
        # Only byte 0xE2 may be drawn: each one opens a three-byte character the next one breaks, so
        # tokens decode to no text (the first) or to U+FFFD a token late, and the last one's text
        # comes only when the stream ends. However the writer and the engine interleave, every
        # choice chunk carries at least one token (its logprobs name them) and the last one, with
        # the finish reason, carries the last token: nothing after it but the usage.
        for max_tokens in (1, 4, 7):
            with self.subTest(max_tokens=max_tokens):
                chunks = self.stream("relgen", max_tokens=max_tokens, temperature=0, logprobs=0,
                                     extra_body={"allowed_token_ids": [0xE2]},
                                     stream_options={"include_usage": True})
                usage = chunks.pop()
                self.assertEqual(usage.choices, [])
                self.assertEqual(usage.usage.completion_tokens, max_tokens)
                counts = [len(c.choices[0].logprobs.tokens) for c in chunks]
                self.assertTrue(all(n >= 1 for n in counts), counts)
                self.assertEqual(sum(counts), max_tokens)
                self.assertEqual([c.choices[0].finish_reason for c in chunks[:-1]], [None] * (len(chunks) - 1))
                self.assertEqual(chunks[-1].choices[0].finish_reason, "length")
                self.assertEqual("".join(c.choices[0].text for c in chunks), "\ufffd" * max_tokens)

    def test_default_max_tokens_is_16(self):
        r = self.complete("relgen", temperature=0)
        g = self.grpc.generate("relgen", max_new_tokens=16, temperature=0, ignore_eos=True)
        self.assertEqual(r.usage.completion_tokens, 16)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.choices[0].text, g.text)

    def test_sampling_parameters_map_to_grpc(self):
        r = self.complete("relgen", max_tokens=20, temperature=0.8, top_p=0.9, seed=7,
                          extra_body={"top_k": 20, "repetition_penalty": 1.3})
        g = self.grpc.generate("relgen", max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7, top_k=20,
                               repetition_penalty=1.3, ignore_eos=True)
        self.assertEqual(r.choices[0].text, g.text)
        self.assertEqual(r.usage.completion_tokens, g.generated_tokens)

    def test_seed_reproduces(self):
        a = self.complete("relgen", max_tokens=20, temperature=1, seed=5)
        b = self.complete("relgen", max_tokens=20, temperature=1, seed=5)
        g = self.grpc.generate("relgen", max_new_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
        self.assertEqual(a.choices[0].text, b.choices[0].text)
        self.assertEqual(a.choices[0].text, g.text)

    def test_n_samples_of_a_batch(self):
        prompts = ["relgen", "Hello"]
        params = dict(max_tokens=12, temperature=1, seed=21, n=3, logprobs=1)
        r = self.complete(prompts, **params)
        choices = self.sorted_choices(r)
        self.assertEqual(len(choices), len(prompts) * 3)
        prompt_tokens = 0
        for p, prompt in enumerate(prompts):
            g = self.grpc.generate(prompt, max_new_tokens=12, temperature=1.0, seed=21, n=3, logprobs=1,
                                   ignore_eos=True)
            prompt_tokens += g.prompt_tokens
            samples = grpc_samples(g)
            self.assertEqual(len(samples), 3)
            for j, sample in enumerate(samples):
                choice = choices[p * 3 + j]
                with self.subTest(prompt=prompt, sample=j):
                    self.assertEqual(choice.text, sample.text)
                    self.assertEqual(choice.finish_reason, "length")
                    self.assert_token_logprobs(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                               choice.logprobs.top_logprobs, sample.logprobs, 1)
                    self.assert_tokens_at_offsets(choice.logprobs, choice.text)
        self.assertEqual(r.usage.prompt_tokens, prompt_tokens)  # each prompt once, not per sample
        self.assertEqual(r.usage.completion_tokens, len(prompts) * 3 * 12)
        self.assertEqual(r.usage.total_tokens, prompt_tokens + len(prompts) * 3 * 12)
        chunks = self.stream(prompts, stream_options={"include_usage": True}, **params)
        self.assert_stream_equals(chunks, r)

    def test_batches_and_token_id_prompts(self):
        for prompt in ([[10, 20, 30], [40, 50, 60, 70]], ["relgen", "The quick brown fox"]):
            with self.subTest(prompt=prompt):
                r = self.complete(prompt, max_tokens=10, temperature=0)
                choices = self.sorted_choices(r)
                self.assertEqual(len(choices), 2)
                prompt_tokens = 0
                for choice, one in zip(choices, prompt):
                    g = self.grpc.generate(one, max_new_tokens=10, temperature=0, ignore_eos=True)
                    prompt_tokens += g.prompt_tokens
                    self.assertEqual(choice.text, g.text)
                    self.assertEqual(choice.finish_reason, "length")
                    single = self.complete(one, max_tokens=10, temperature=0)
                    self.assertEqual(single.choices[0].text, g.text)
                    self.assertEqual(single.usage.prompt_tokens, g.prompt_tokens)
                self.assertEqual(r.usage.prompt_tokens, prompt_tokens)
                self.assertEqual(r.usage.completion_tokens, 20)
        self.assertEqual(self.complete([10, 20, 30], max_tokens=4).usage.prompt_tokens, 3)

    def test_stop_string_ends_the_text_before_it(self):
        prompt = [10, 20, 30]
        greedy = self.grpc.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True).text
        # Two printable ASCII characters of the greedy text, first found past its start: generation
        # must stop right before them.
        at = next((i for i in range(1, len(greedy) - 1)
                   if all(" " <= ch <= "~" for ch in greedy[i:i + 2]) and greedy.find(greedy[i:i + 2]) == i), None)
        self.assertIsNotNone(at, f"no stop string to pick from {greedy!r}")
        stop = greedy[at:at + 2]
        g = self.grpc.generate(prompt, max_new_tokens=48, temperature=0, ignore_eos=True, stop=[stop])
        self.assertEqual(g.finish_reason, "stop")
        self.assertEqual(g.text, greedy[:at])
        for form in (stop, [stop, "never in the output \u2603"]):
            with self.subTest(stop=form):
                r = self.complete(prompt, max_tokens=48, temperature=0, stop=form)
                self.assertEqual(r.choices[0].finish_reason, "stop")
                self.assertEqual(r.choices[0].text, greedy[:at])
                self.assertEqual(r.choices[0].text, g.text)
                self.assertEqual(r.usage.completion_tokens, g.generated_tokens)
                chunks = self.stream(prompt, max_tokens=48, temperature=0, stop=form,
                                     stream_options={"include_usage": True})
                self.assert_stream_equals(chunks, r)

    def test_stop_token_ids(self):
        prompt = "relgen"
        greedy = self.grpc.generate(prompt, max_new_tokens=32, temperature=0, ignore_eos=True)
        token = greedy.token_ids[5]
        g = self.grpc.generate(prompt, max_new_tokens=32, temperature=0, ignore_eos=True, stop_token_ids=[token])
        self.assertEqual(g.finish_reason, "stop")
        r = self.complete(prompt, max_tokens=32, temperature=0, logprobs=0, extra_body={"stop_token_ids": [token]})
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[0].text, g.text)
        self.assertEqual(r.usage.completion_tokens, g.generated_tokens)
        self.assertEqual(len(r.choices[0].logprobs.tokens), g.generated_tokens)
        self.assertLessEqual(g.generated_tokens, 6)

    def test_echo(self):
        prompt = "relgen"
        g = self.grpc.generate(prompt, max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=2,
                               prompt_logprobs=2)
        plain = self.complete(prompt, max_tokens=8, temperature=0, echo=True)
        self.assertEqual(plain.choices[0].text, prompt + g.text)
        self.assertIsNone(plain.choices[0].logprobs)

        r = self.complete(prompt, max_tokens=8, temperature=0, echo=True, logprobs=2)
        choice = r.choices[0]
        self.assertEqual(choice.text, prompt + g.text)
        self.assertEqual(r.usage.prompt_tokens, g.prompt_tokens)
        self.assertEqual(r.usage.completion_tokens, 8)
        lp = choice.logprobs
        k = g.prompt_tokens  # the prompt's tokens first (its BOS among them), then the generated ones
        self.assertEqual(len(g.prompt_logprobs), k - 1)
        self.assertEqual(len(lp.tokens), k + 8)
        self.assertEqual(len(lp.text_offset), k + 8)
        self.assertIsNone(lp.token_logprobs[0])
        self.assertIsNone(lp.top_logprobs[0])
        self.assert_token_logprobs(lp.tokens[1:k], lp.token_logprobs[1:k], lp.top_logprobs[1:k], g.prompt_logprobs, 2)
        self.assertEqual(lp.tokens[k - len(prompt):k], list(prompt))
        self.assert_token_logprobs(lp.tokens[k:], lp.token_logprobs[k:], lp.top_logprobs[k:], g.logprobs, 2)
        self.assert_text_offsets(lp.text_offset, choice.text, 0)
        self.assertEqual(lp.text_offset[k], len(prompt))

    def test_max_tokens_0_with_echo_scores_the_prompt(self):
        # The score-only request of lm-eval and other OpenAI-style clients: the prompt back, its
        # tokens' log-probabilities (the first has none), no new token.
        prompt = "relgen scores"
        g = self.grpc.generate(prompt, max_new_tokens=1, temperature=0, prompt_logprobs=2)
        k = g.prompt_tokens
        r = self.complete(prompt, max_tokens=0, echo=True, logprobs=2, n=2)
        self.assertEqual(r.usage.prompt_tokens, k)
        self.assertEqual(r.usage.completion_tokens, 0)
        self.assertEqual(len(r.choices), 2)
        for choice in r.choices:
            self.assertEqual(choice.text, prompt)
            self.assertEqual(choice.finish_reason, "length")
            lp = choice.logprobs
            self.assertEqual(len(lp.tokens), k)
            self.assertIsNone(lp.token_logprobs[0])
            self.assertIsNone(lp.top_logprobs[0])
            self.assert_token_logprobs(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], g.prompt_logprobs, 2)
            self.assert_text_offsets(lp.text_offset, choice.text, 0)
        chunks = self.stream(prompt, max_tokens=0, echo=True, logprobs=2, n=2, stream_options={"include_usage": True})
        self.assert_stream_equals(chunks, r)
        # Without logprobs, the prompt alone; without echo, nothing.
        plain = self.complete(prompt, max_tokens=0, echo=True)
        self.assertEqual(plain.choices[0].text, prompt)
        self.assertIsNone(plain.choices[0].logprobs)
        self.assertEqual(plain.choices[0].finish_reason, "length")
        bare = self.complete(prompt, max_tokens=0)
        self.assertEqual(bare.choices[0].text, "")
        self.assertEqual(bare.usage.completion_tokens, 0)
        # Below 0 is refused, naming what is allowed.
        response = self.http.post("/v1/completions", json={"model": self.model, "prompt": prompt, "max_tokens": -1})
        self.assertEqual(response.status_code, 400, response.text)
        self.assertEqual(response.json()["error"]["param"], "max_tokens")
        self.assertIn("max_new_tokens: -1; allowed 0..", response.json()["error"]["message"])

    # --- vLLM's small endpoints and plain answers --------------------------------------------------

    def served_config(self):
        with open(os.path.join(os.environ["RELGEN_GOLDEN_DIR"], "engine", "skew", "config.json")) as f:
            return json.load(f)

    def test_tokenize_gives_the_prompt_tokens(self):
        # The byte-level tokenizer: the model's BOS (config.json), then one id per UTF-8 byte.
        config = self.served_config()
        text = "relgen \u00e9 \u2713"
        want = [config["bos_token_id"]] + list(text.encode("utf-8"))
        r = self.http.post("/tokenize", json={"model": self.model, "prompt": text})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"count": len(want), "max_model_len": config["max_seq_len"], "tokens": want,
                                    "token_strs": None})
        # The same prompt's tokens as a completion counts them.
        self.assertEqual(self.complete(text, max_tokens=1, temperature=0).usage.prompt_tokens, len(want))
        # No model named (vLLM's clients may leave it out), no special tokens, the tokens' strings.
        r = self.http.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json()["tokens"], want[1:])
        self.assertEqual(r.json()["token_strs"][:7], list("relgen "))
        self.assertEqual(len(r.json()["token_strs"]), len(want) - 1)

    def test_detokenize_gives_the_text_back(self):
        text = "relgen \u00e9 \u2713"
        r = self.http.post("/detokenize", json={"model": self.model, "tokens": list(text.encode("utf-8"))})
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"prompt": text})
        # An incomplete character decodes to U+FFFD, as a stream ends it.
        r = self.http.post("/detokenize", json={"tokens": list("\u2713".encode("utf-8"))[:2]})
        self.assertEqual(r.json(), {"prompt": "\ufffd"})

    def test_tokenizer_endpoints_name_what_is_wrong(self):
        vocab = self.served_config()["vocab_size"]
        for path, body, status, param in (
                ("/tokenize", {"model": "another-model", "prompt": "x"}, 404, "model"),
                ("/tokenize", {"model": self.model}, 400, "prompt"),
                ("/tokenize", {"prompt": 3}, 400, "prompt"),
                ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
                ("/tokenize", [1, 2], 400, "body"),
                ("/detokenize", {"model": "another-model", "tokens": [1]}, 404, "model"),
                ("/detokenize", {"tokens": [1, vocab]}, 400, "tokens"),
                ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
                ("/detokenize", {"tokens": "abc"}, 400, "tokens")):
            with self.subTest(path=path, body=body):
                error = self.assert_raw_error(self.http.post(path, json=body), status)
                self.assertEqual(error["param"], param, error)
        error = self.assert_raw_error(
            self.http.post("/tokenize", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
        self.assertEqual(error["param"], "body", error)

    def test_version_is_the_projects(self):
        with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
            want = re.search(r"project\(relgen VERSION (\S+)", f.read()).group(1)
        r = self.http.get("/version")
        self.assertEqual(r.status_code, 200, r.text)
        self.assertEqual(r.json(), {"version": want})

    def test_the_client_offers_debians_brotli(self):
        # The condition the other tests run in: the openai client's httpx finds Debian's brotli
        # module (python3-brotli, tools/bootstrap.sh) and offers br with every request, as aiohttp
        # does under lm-eval; relgen answers them all as is (below).
        import brotli
        self.assertTrue(brotli.__file__.startswith("/usr/lib/python3/dist-packages"), brotli.__file__)
        self.assertIn("br", httpx.Client().headers["accept-encoding"])
        self.assertIsNone(self.http.get("/v1/models").headers.get("content-encoding"))

    def test_answers_are_not_compressed_whatever_the_client_offers(self):
        # The raw bytes on the wire (http.client decodes nothing): JSON, with no Content-Encoding.
        offer = {"Accept-Encoding": "br, gzip, deflate", "Content-Type": "application/json"}
        body = json.dumps({"model": self.model, "prompt": "relgen", "max_tokens": 4, "ignore_eos": True})
        for address, method, path, payload in ((self.server.http, "POST", "/v1/completions", body),
                                               (self.server.http, "GET", "/v1/models", None),
                                               (self.server.http, "POST", "/tokenize", json.dumps({"prompt": "x"})),
                                               (self.server.metrics, "GET", "/metrics", None)):
            with self.subTest(path=path):
                raw = raw_request(address, method, path, payload, offer)
                self.assertEqual(raw.status, 200)
                self.assertIsNone(raw.getheader("Content-Encoding"))
                data = raw.read()
                if path != "/metrics":
                    json.loads(data)
                else:
                    self.assertIn(b"relgen_", data)

    def test_neutral_openai_fields_are_accepted(self):
        want = self.grpc.generate("relgen", max_new_tokens=8, temperature=0, ignore_eos=True).text
        r = self.complete("relgen", max_tokens=8, temperature=0, presence_penalty=0, frequency_penalty=0,
                          logit_bias={}, best_of=1)
        self.assertEqual(r.choices[0].text, want)
        r = self.complete("relgen", max_tokens=8, temperature=0, n=2, best_of=2)
        self.assertEqual([c.text for c in self.sorted_choices(r)], [want, want])

    # --- errors -----------------------------------------------------------------------------------

    def test_invalid_fields_are_named(self):
        cases = [
            ("top_p", dict(top_p=1.5)),
            ("temperature", dict(temperature=-1)),
            ("n", dict(n=17)),
            ("logprobs", dict(logprobs=21)),
            ("top_k", dict(extra_body={"top_k": -2})),  # -1 is vLLM's "off"
            ("repetition_penalty", dict(extra_body={"repetition_penalty": 0})),
            ("presence_penalty", dict(presence_penalty=2.5)),
            ("frequency_penalty", dict(frequency_penalty=-2.5)),
            ("logit_bias", dict(logit_bias={"10": 500})),
            # OpenAI fields the server does not support.
            ("suffix", dict(suffix="x")),
            ("best_of", dict(best_of=2)),
        ]
        for field, params in cases:
            with self.subTest(field=field):
                with self.assertRaises(openai.BadRequestError) as raised:
                    self.complete("relgen", max_tokens=4, **params)
                self.assert_error(raised, 400, "invalid_request_error", param=field, names=[field])
                self.assertEqual(raised.exception.param, field)

    def test_unknown_field_is_named(self):
        with self.assertRaises(openai.BadRequestError) as raised:
            self.complete("relgen", max_tokens=4, extra_body={"foo": 1})
        self.assert_error(raised, 400, "invalid_request_error", names=["foo"])

    def test_bad_json_is_400(self):
        for body in (b'{"model": ', b"[1, 2]", b"not json"):
            with self.subTest(body=body):
                response = self.http.post("/v1/completions", content=body,
                                          headers={"content-type": "application/json"})
                self.assert_raw_error(response, 400, "invalid_request_error")
        response = self.http.post("/v1/completions", json={"model": self.model})  # no prompt
        self.assert_raw_error(response, 400, "invalid_request_error")

    def test_unknown_model_is_404(self):
        with self.assertRaises(openai.NotFoundError) as raised:
            self.client.completions.create(model="no-such-model", prompt="relgen", max_tokens=4)
        error = self.assert_error(raised, 404)
        self.assertEqual(error["code"], "model_not_found")
        self.assertEqual(raised.exception.code, "model_not_found")

    def test_unknown_route_is_404(self):
        for method, path in (("GET", "/v1/no-such-route"), ("POST", "/v1/embeddings")):
            with self.subTest(path=path):
                self.assert_raw_error(self.http.request(method, path), 404)

    def test_chat_completions_point_to_completions(self):
        with self.assertRaises(openai.NotFoundError) as raised:
            self.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "hi"}])
        error = self.assert_error(raised, 404, names=["/v1/completions"])
        self.assertIn("chat", error["message"].lower())


def raw_request(address, method, path, body, headers):
    """An HTTP/1.1 request through http.client, which neither offers nor decodes any encoding by
    itself; the response, unread."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers=headers)
    return conn.getresponse()


class CompressionTest(OpenAIApiTestCase):
    """--http_compression: answers in gzip where the client offers it, and as is where it does not."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server("--http_compression")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_gzip_where_offered(self):
        for address, path in ((self.server.http, "/v1/models"), (self.server.metrics, "/metrics")):
            with self.subTest(path=path):
                raw = raw_request(address, "GET", path, None, {"Accept-Encoding": "gzip"})
                self.assertEqual(raw.status, 200)
                self.assertEqual(raw.getheader("Content-Encoding"), "gzip")
                data = gzip.decompress(raw.read())
                if path == "/v1/models":
                    self.assertEqual(json.loads(data)["data"][0]["id"], "engine-skew")
                else:
                    self.assertIn(b"relgen_", data)
                plain = raw_request(address, "GET", path, None, {})
                self.assertIsNone(plain.getheader("Content-Encoding"))
                plain.read()


class BearerTokenTest(OpenAIApiTestCase):
    TOKEN = "openai-api-test-token"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="openai-api-test-")
        token_file = os.path.join(cls.tmp, "token")
        with open(token_file, "w") as f:
            f.write(cls.TOKEN + "\n")
        cls.server = Server("--auth_token_file", token_file)

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_right_token_is_served(self):
        with openai_client(self.server, api_key=self.TOKEN) as client:
            model = client.models.list().data[0].id
            r = client.completions.create(model=model, prompt="relgen", max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        self.assertEqual(r.usage.completion_tokens, 4)

    def test_wrong_token_is_401(self):
        with openai_client(self.server, api_key="not-" + self.TOKEN) as client:
            with self.assertRaises(openai.AuthenticationError) as raised:
                client.completions.create(model="engine-skew", prompt="relgen", max_tokens=4)
            self.assert_error(raised, 401)

    def test_missing_token_is_401(self):
        with httpx.Client(base_url=f"http://{self.server.http}", timeout=60) as http:
            response = http.post("/v1/completions", json={"model": "engine-skew", "prompt": "relgen", "max_tokens": 4})
            self.assert_raw_error(response, 401)

    def test_tokenizer_endpoints_need_the_token(self):
        with httpx.Client(base_url=f"http://{self.server.http}", timeout=60) as http:
            for path, body in (("/tokenize", {"prompt": "relgen"}), ("/detokenize", {"tokens": [114]})):
                with self.subTest(path=path):
                    self.assert_raw_error(http.post(path, json=body), 401)
                    r = http.post(path, json=body, headers={"Authorization": f"Bearer {self.TOKEN}"})
                    self.assertEqual(r.status_code, 200, r.text)

    def test_an_unauthenticated_body_is_not_read(self):
        # The request path reads a completion's body only once the caller may be served: a body
        # that is not JSON, or names another model, is answered 401, never with what is wrong in it.
        with httpx.Client(base_url=f"http://{self.server.http}", timeout=60) as http:
            for body in (b"{not json", b'{"model": "another-model", "prompt": "relgen"}'):
                response = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                error = self.assert_raw_error(response, 401)
                self.assertIsNone(error["param"], response.text)


class QueueAndDrainTest(OpenAIApiTestCase):
    """429 when the queue is full and 503 while draining, each state made with the server's test hooks
    (the engine held before its next step), never with timing."""

    def test_full_queue_is_429_and_draining_is_503(self):
        server = Server("--max_waiting", "1", "--enable_test_hooks", "--drain_grace_seconds", "60")
        admin = httpx.Client(base_url=f"http://{server.metrics}", timeout=60)
        try:
            def waiting():
                for line in admin.get("/metrics").text.splitlines():
                    if line.startswith("relgen_num_requests_waiting "):
                        return float(line.split()[1])
                return -1

            def until(predicate):
                for _ in range(2400):  # a bound for a failing test only
                    if predicate():
                        return
                    time.sleep(0.05)
                self.fail("the server never reached the state")

            with openai_client(server) as client:
                model = client.models.list().data[0].id

                def held():  # a request queued behind the held engine, answered once it goes on
                    return client.completions.create(model=model, prompt="held", max_tokens=3,
                                                     extra_body={"ignore_eos": True})

                self.assertEqual(admin.post("/testing/pause").status_code, 200)
                first = threading.Thread(target=lambda: results.append(held()))
                results = []
                first.start()
                until(lambda: waiting() == 1)
                with self.assertRaises(openai.RateLimitError) as raised:
                    held()
                self.assert_error(raised, 429, "rate_limit_error", names=("queue is full",))
                self.assertEqual(admin.post("/testing/resume").status_code, 200)
                first.join()
                self.assertEqual(results[0].usage.completion_tokens, 3)

                # Draining: a request in flight keeps the server draining until it is let go.
                self.assertEqual(admin.post("/testing/pause").status_code, 200)
                second = threading.Thread(target=lambda: results.append(held()))
                second.start()
                until(lambda: waiting() == 1)
                server.proc.send_signal(signal.SIGTERM)
                until(lambda: admin.get("/readyz").status_code == 503)
                with self.assertRaises(openai.InternalServerError) as raised:
                    held()
                self.assert_error(raised, 503, "server_error", names=("draining",))
                self.assertEqual(admin.post("/testing/resume").status_code, 200)
                second.join()
                self.assertEqual(results[1].usage.completion_tokens, 3)
            self.assertEqual(server.proc.wait(timeout=60), 0, server.log())
        finally:
            admin.close()
            server.stop()


class ReadmeExamplesTest(unittest.TestCase):
    """The README's HTTP examples, as shown, against a server of the default model they name."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(model=os.path.join(SOURCE, "models", "default"))
        with open(os.path.join(SOURCE, "README.md")) as f:
            readme = f.read()
        blocks = re.findall(r"```(sh|python)\n(.*?)```", readme, re.S)
        cls.curls = [cmd for lang, body in blocks if lang == "sh"
                     for cmd in body.replace("\\\n", " ").splitlines() if cmd.startswith("curl ")]
        cls.python = [body for lang, body in blocks if lang == "python" and "OpenAI(" in body]

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def local(self, text):
        self.assertIn("localhost:8000", text)
        return text.replace("localhost:8000", self.server.http)

    def test_curl_examples(self):
        self.assertGreaterEqual(len(self.curls), 4, "the README's curl examples")
        for cmd in self.curls:
            with self.subTest(cmd=cmd):
                done = subprocess.run(["bash", "-c", self.local(cmd) + " -w '\\n%{http_code}'"], capture_output=True,
                                      text=True, timeout=120)
                self.assertEqual(done.returncode, 0, done.stderr)
                body, _, code = done.stdout.rpartition("\n")
                self.assertEqual(code, "200", body)
                if '"stream": true' in cmd:
                    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
                    self.assertEqual(events[-1], "[DONE]")
                    chunks = [json.loads(e) for e in events[:-1]]
                    finished = {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]}
                    self.assertEqual(finished, {0, 1, 2, 3}, "two prompts of two samples each")
                else:
                    answer = json.loads(body)
                    self.assertNotIn("error", answer)
                    self.assertEqual(answer["data"][0]["id"] if "data" in answer else answer["model"],
                                     "relgen-default-fortunes")

    def test_python_example(self):
        self.assertEqual(len(self.python), 1, "the README's openai example")
        done = subprocess.run([sys.executable, "-c", self.local(self.python[0])], capture_output=True, text=True,
                              timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
