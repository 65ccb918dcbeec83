"""LoRA adapters through the server: relgen-server --lora_modules on the tiny BLOOM and T5 bases of
tools/make_lora_adapters.py, with two resident slots for three adapters, against PEFT's outputs.

- GET /v1/models lists the base and each adapter with the base as its parent.
- Every (adapter or base, prompt) as a gRPC request, all at once from threads: PEFT's greedy tokens.
- HTTP /v1/completions with `model` = an adapter's name: the same text as gRPC under that adapter.
- Score under an adapter: each continuation token's log-probability within 1e-4 of PEFT's.
- relgen_requests_total counts each adapter's requests under its name (label `adapter`).
- An unknown adapter: gRPC NOT_FOUND and HTTP 404, naming it; a broken adapter: the server refuses to
  start, naming what is wrong.

Run by CTest with the build-hf-venv python; RELGEN_SERVER_BIN and RELGEN_LORA_CASES_DIR set, and
RELGEN_SERVER_ARGS (space-separated) where the server needs more: lora_server_test_emu runs it on the
emulated CUDA backend in float32 (--device cuda --weights_dtype f32 --kv_cache_dtype f32)."""
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_api_test import Server, relgen_client  # noqa: E402  (stubs and the client from the source tree)

from safetensors.numpy import load_file  # noqa: E402

CASES = os.environ["RELGEN_LORA_CASES_DIR"]
SERVER_ARGS = os.environ.get("RELGEN_SERVER_ARGS", "").split()
with open(os.path.join(CASES, "manifest.json")) as f:
    MANIFEST = json.load(f)


def base(name):
    return next(b for b in MANIFEST["bases"] if b["name"] == name)


def reference(entry, t5):
    """Per prompt: (prompt ids, greedy ids, logits [rows, vocab] before each greedy token)."""
    ref = load_file(entry["reference"])
    out = []
    for i in range(entry["prompts"]):
        prompt = ref[("input_" if t5 else "prompt_") + str(i)].tolist()
        greedy = ref[f"greedy_{i}"].tolist()
        logits = ref[f"logits_{i}"]
        out.append((prompt, greedy, logits if t5 else logits[len(prompt) - 1:]))
    return out


def post(server, path, body):
    req = urllib.request.Request(f"http://{server.http}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


class LoraServerTest(unittest.TestCase):
    def serve(self, name):
        b = base(name)
        modules = ",".join(f"{a['name']}={a['dir']}" for a in b["adapters"])
        return b, Server(*SERVER_ARGS, "--lora_modules", modules, "--max_loras", "2", "--max_lora_rank", "16", model=b["dir"])

    def check_base(self, name):
        b, server = self.serve(name)
        t5 = b["family"] == "t5"
        try:
            client = relgen_client.Client(server.grpc, timeout=120)
            with urllib.request.urlopen(f"http://{server.http}/v1/models", timeout=60) as r:
                models = json.load(r)["data"]
            base_id = models[0]["id"]
            self.assertEqual([(m["id"], m["parent"]) for m in models],
                             [(base_id, None)] + [(a["name"], base_id) for a in b["adapters"]])
            entries = [("", b)] + [(a["name"], a) for a in b["adapters"]]
            work = [(adapter, prompt, greedy) for adapter, e in entries for prompt, greedy, _ in reference(e, t5)]

            def run(item):
                adapter, prompt, greedy = item
                return client.generate(prompt, temperature=0, max_new_tokens=len(greedy), ignore_eos=True,
                                       adapter=adapter)

            with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
                results = list(pool.map(run, work))
            for (adapter, prompt, greedy), got in zip(work, results):
                self.assertEqual(got.token_ids, greedy, f"{name} {adapter or 'base'} prompt of {len(prompt)}")

            # HTTP: the adapter by `model`, the same text as gRPC's.
            adapter, prompt, greedy = work[-1]
            status, body = post(server, "/v1/completions", {"model": adapter, "prompt": prompt, "temperature": 0,
                                                            "max_tokens": len(greedy), "ignore_eos": True})
            self.assertEqual(status, 200, body)
            self.assertEqual(body["model"], adapter)
            self.assertEqual(body["choices"][0]["text"], results[-1].text)

            # Score: PEFT's log-probabilities of its own greedy tokens.
            for adapter, e in entries[1:]:
                prompt, greedy, logits = reference(e, t5)[-1]
                scored = client.score(prompt, [greedy], adapter=adapter).scores[0]
                for t, (token, row) in enumerate(zip(greedy, logits)):
                    row = row.astype("float64")
                    m = row.max()
                    want = row[token] - m - math.log(sum(math.exp(x - m) for x in row))
                    self.assertAlmostEqual(scored.logprobs[t].logprob, want, delta=1e-4,
                                           msg=f"{name} {adapter} token {t}")

            # The finished requests' counter by adapter: three prompts' requests each, one Score's.
            with urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=60) as r:
                text = r.read().decode()
            for a in b["adapters"]:
                line = f'relgen_requests_total{{adapter="{a["name"]}",finish_reason="length"}} '
                self.assertIn(line, text)
                want = 3 + 1 + (1 if a["name"] == work[-1][0] else 0)  # generate x 3, score, the HTTP one
                self.assertEqual(float(text.split(line)[1].split()[0]), want, a["name"])

            # Unknown names.
            with self.assertRaises(relgen_client.RelgenError) as err:
                client.generate(prompt, max_new_tokens=1, adapter="no-such-adapter")
            self.assertEqual(err.exception.code, "NOT_FOUND")
            self.assertIn("'no-such-adapter'", err.exception.details)
            status, body = post(server, "/v1/completions", {"model": "no-such-adapter", "prompt": prompt})
            self.assertEqual(status, 404, body)
            self.assertIn("'no-such-adapter'", body["error"]["message"])
            self.assertIn(b["adapters"][0]["name"], body["error"]["message"])
            client.close()
        finally:
            server.stop()

    def test_bloom(self):
        self.check_base("bloom")

    def test_t5(self):
        self.check_base("t5")

    def test_a_broken_adapter_stops_the_start(self):
        bad = next(x for x in MANIFEST["bad"] if x["name"] == "mpt-rank-64")
        r = subprocess.run([os.environ["RELGEN_SERVER_BIN"], *SERVER_ARGS, "--model", base(bad["base"])["dir"], "--listen",
                            "127.0.0.1:0", "--metrics_listen", "127.0.0.1:0", "--http_listen", "127.0.0.1:0",
                            "--lora_modules", f"big={bad['dir']}", "--max_lora_rank", "16"],
                           capture_output=True, text=True, timeout=120)
        self.assertNotEqual(r.returncode, 0)
        for want in bad["expect"] + ["'big'"]:
            self.assertIn(want, r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main()
