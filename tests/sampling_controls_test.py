"""The sampling controls (presence/frequency penalties, logit bias, allowed ids, bad words,
min_tokens, no_repeat_ngram_size, truncate_prompt_tokens, skip_special_tokens) end to end, against transformers' logits processors on the same
tiny Hugging Face checkpoints (BLOOM and T5, random weights, made by tools/make_hf_checkpoints.py
and tools/make_t5_checkpoints.py).

The reference decodes greedily with transformers' forward() in a loop (torch 1.13's generate()
trips on an fsdp import), applying RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor and MinNewTokensLengthLogitsProcessor,
OpenAI's presence/frequency
definition and an allowed-ids mask, in relgen's order (engine/backends/sampler.h). relgen answers
over gRPC and over the OpenAI-compatible HTTP API; both must give the reference's tokens.

Run by CTest with the build-hf-venv python; RELGEN_SERVER_BIN, RELGEN_HF_CASES_DIR and
RELGEN_T5_CASES_DIR set."""
import json
import os
import sys
import unittest
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_api_test import Server, relgen_client  # noqa: E402  (stubs and the client from the source tree)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, T5ForConditionalGeneration  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

NEW_TOKENS = 20
# The reference's best processed logit must lead the next by this much at every step, so float32
# differences between the two implementations (about 1e-6 on these models) cannot flip a choice.
DECISIVE = 1e-4


def _case(manifest_dir, name):
    with open(os.path.join(manifest_dir, "manifest.json")) as f:
        manifest = json.load(f)
    for case in manifest["cases"]:
        if case["name"] == name:
            return case
    raise RuntimeError(f"no case {name} in {manifest_dir}/manifest.json")


def _model_id(server):
    with urllib.request.urlopen(f"http://{server.http}/v1/models", timeout=60) as r:
        return json.load(r)["data"][0]["id"]


class Reference:
    """Greedy decoding with the controls applied as transformers' processors define them."""

    def __init__(self, model, encoder_decoder, eos, start=None):
        self.model, self.encoder_decoder, self.eos, self.start = model, encoder_decoder, eos, start

    def generate(self, prompt, *, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                 logit_bias=None, allowed_token_ids=(), bad_words=(), min_tokens=0, stop_token_ids=(),
                 no_repeat_ngram_size=0, truncate_prompt_tokens=0, max_new_tokens=NEW_TOKENS):
        if truncate_prompt_tokens:
            prompt = prompt[-truncate_prompt_tokens:]
        seq = [self.start] if self.encoder_decoder else list(prompt)  # the history
        out = []
        processors = []
        if repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
        with torch.no_grad():
            for _ in range(max_new_tokens):
                ids = torch.tensor([seq])
                if self.encoder_decoder:
                    logits = self.model(input_ids=torch.tensor([prompt]), decoder_input_ids=ids).logits[0, -1]
                else:
                    logits = self.model(input_ids=ids).logits[0, -1]
                scores = logits.float().unsqueeze(0).clone()
                for p in processors:
                    scores = p(ids, scores)
                counts = torch.zeros_like(scores)
                for t in out:
                    counts[0, t] += 1
                scores = scores - frequency_penalty * counts - presence_penalty * (counts > 0).float()
                if logit_bias:
                    scores = SequenceBiasLogitsProcessor({(t,): b for t, b in logit_bias.items()})(ids, scores)
                if allowed_token_ids:
                    mask = torch.full_like(scores, -float("inf"))
                    mask[0, list(allowed_token_ids)] = 0
                    scores = scores + mask
                if bad_words:
                    scores = NoBadWordsLogitsProcessor([list(w) for w in bad_words])(ids, scores)
                if no_repeat_ngram_size:
                    scores = NoRepeatNGramLogitsProcessor(no_repeat_ngram_size)(ids, scores)
                if min_tokens:
                    banned = list(stop_token_ids) + [self.eos]
                    scores = MinNewTokensLengthLogitsProcessor(len(seq) - len(out), min_tokens, banned)(ids, scores)
                top2 = torch.topk(scores[0], 2)
                if top2.values[0] - top2.values[1] < DECISIVE:
                    raise AssertionError(f"the reference's step {len(out)} is not decisive ({top2}): choose another case")
                t = int(top2.indices[0])
                out.append(t)
                seq.append(t)
                if t == self.eos or t in stop_token_ids:
                    break
        return out


class ControlsTestBase:
    """Each control alone and combined, greedy, on one checkpoint: gRPC and HTTP give the reference's
    tokens."""

    @classmethod
    def setUpClass(cls):
        case = _case(os.environ[cls.cases_env], cls.case_name)
        model, cls.ref = cls.load(case["dir"])
        cls.eos = model.config.eos_token_id
        cls.prompt = case["text_ids"][:12]
        cls.tokenizer = AutoTokenizer.from_pretrained(case["dir"])
        cls.server = Server(model=case["dir"])
        cls.grpc = relgen_client.Client(cls.server.grpc, timeout=60)
        cls.model_name = _model_id(cls.server)

    @classmethod
    def tearDownClass(cls):
        cls.grpc.close()
        cls.server.stop()

    def relgen(self, prompt, **controls):
        params = dict(controls)
        params.setdefault("max_new_tokens", NEW_TOKENS)
        c = self.grpc.generate(prompt, temperature=0, **params)
        return c.token_ids

    def expect(self, **controls):
        want = self.ref.generate(self.prompt, **controls)
        got = self.relgen(self.prompt, **controls)
        self.assertEqual(got, want, controls)
        return want

    def test_baseline_differs_from_each_controlled_run(self):
        # The controls below change the greedy output, so each comparison is a real one.
        base = self.expect()
        self.assertNotEqual(base, self.ref.generate(self.prompt, presence_penalty=1.5))
        self.assertNotEqual(base, self.ref.generate(self.prompt, bad_words=[[base[0]]]))

    def test_presence_and_frequency_penalties(self):
        self.expect(presence_penalty=1.5)
        self.expect(frequency_penalty=0.9)
        self.expect(presence_penalty=0.7, frequency_penalty=0.4)
        self.expect(presence_penalty=-1.0)

    def test_logit_bias(self):
        base = self.ref.generate(self.prompt)
        self.expect(logit_bias={base[0]: -100.0, 17: 3.0})
        self.expect(logit_bias={base[1]: -2.5, 42: 1.5, 43: 1.0})

    def test_allowed_token_ids(self):
        self.expect(allowed_token_ids=list(range(50, 150)))
        self.expect(allowed_token_ids=[5, 77, 140, 201, 333, self.eos])

    def test_bad_words(self):
        base = self.ref.generate(self.prompt)
        self.expect(bad_words=[[base[0]]])
        self.expect(bad_words=[[base[0], base[1]], [base[2], base[3], base[4]]])

    def test_no_repeat_ngram_size(self):
        base = self.ref.generate(self.prompt)
        for n in (1, 2, 3):
            with self.subTest(n=n):
                self.assertNotEqual(self.expect(no_repeat_ngram_size=n), base)
        self.expect(no_repeat_ngram_size=2, presence_penalty=0.5, logit_bias={base[0]: 2.0})

    def test_min_tokens_holds_back_the_stop_ids(self):
        base = self.ref.generate(self.prompt, presence_penalty=1.0)
        stop = base[2]
        early = self.expect(presence_penalty=1.0, stop_token_ids=[stop])
        self.assertEqual(len(early), 3)
        late = self.expect(presence_penalty=1.0, stop_token_ids=[stop], min_tokens=8)
        self.assertGreater(len(late), 8 - 1)

    def test_truncate_prompt_tokens(self):
        self.expect(truncate_prompt_tokens=3)
        self.expect(truncate_prompt_tokens=len(self.prompt) + 10)  # longer than the prompt: all of it

    def test_every_control_together(self):
        base = self.ref.generate(self.prompt)
        self.expect(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                    logit_bias={base[0]: -5.0, 99: 2.0}, allowed_token_ids=list(range(0, 300)),
                    bad_words=[[base[1]], [99, 99]], min_tokens=4, stop_token_ids=[base[3]],
                    truncate_prompt_tokens=4)

    def test_http_api_takes_the_same_controls(self):
        base = self.ref.generate(self.prompt)
        controls = dict(presence_penalty=0.8, frequency_penalty=0.3, logit_bias={base[0]: -3.0},
                        bad_words=[[base[1], base[2]]], min_tokens=5, allowed_token_ids=list(range(0, 350)),
                        truncate_prompt_tokens=4)
        want = self.ref.generate(self.prompt, **controls)
        body = dict(controls, model=self.model_name, prompt=self.prompt, max_tokens=NEW_TOKENS, temperature=0,
                    logprobs=0, logit_bias={str(t): b for t, b in controls["logit_bias"].items()})
        answer = self.post("/v1/completions", body)
        choice = answer["choices"][0]
        self.assertEqual(answer["usage"]["completion_tokens"], len(want))
        self.assertEqual(answer["usage"]["prompt_tokens"], 4)
        grpc_text = self.grpc.generate(self.prompt, temperature=0, max_new_tokens=NEW_TOKENS, **controls).text
        self.assertEqual(choice["text"], grpc_text)

    def test_skip_special_tokens(self):
        # The bias makes the specials (ids 0..3 on both tokenizers) appear in the output.
        bias = {t: 4.0 for t in self.specials}
        c = self.grpc.generate(self.prompt, temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                               logit_bias=bias)
        ids = c.token_ids
        self.assertTrue(any(t in self.specials for t in ids), ids)
        self.assertEqual(c.text, self.tokenizer.decode(ids, skip_special_tokens=True))
        kept = self.grpc.generate(self.prompt, temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                  logit_bias=bias, skip_special_tokens=False)
        self.assertEqual(kept.token_ids, ids)
        self.assertEqual(kept.text, self.tokenizer.decode(ids, skip_special_tokens=False))
        self.assertNotEqual(kept.text, c.text)
        body = {"model": self.model_name, "prompt": self.prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "logit_bias": {str(t): b for t, b in bias.items()},
                "skip_special_tokens": False}
        self.assertEqual(self.post("/v1/completions", body)["choices"][0]["text"], kept.text)

    def test_text_offsets_index_the_text(self):
        # HTTP logprobs' tokens are the text each token added, so with either skip_special_tokens
        # every token's string sits at its text_offset in the choice's text, and the strings
        # concatenate to the text (no stop string cuts it here). The bias makes specials appear.
        bias = {str(t): 4.0 for t in self.specials}
        for skip in (True, False):
            with self.subTest(skip_special_tokens=skip):
                body = {"model": self.model_name, "prompt": self.prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                        "ignore_eos": True, "logit_bias": bias, "logprobs": 1, "skip_special_tokens": skip}
                choice = self.post("/v1/completions", body)["choices"][0]
                text, lp = choice["text"], choice["logprobs"]
                ids = self.grpc.generate(self.prompt, temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                         logit_bias={int(t): b for t, b in bias.items()},
                                         skip_special_tokens=skip).token_ids
                self.assertTrue(any(t in self.specials for t in ids), ids)
                self.assertEqual(text, self.tokenizer.decode(ids, skip_special_tokens=skip))
                self.assertEqual(len(lp["tokens"]), NEW_TOKENS)
                self.assertEqual(len(lp["text_offset"]), NEW_TOKENS)
                for i, (token, offset) in enumerate(zip(lp["tokens"], lp["text_offset"])):
                    self.assertEqual(text[offset:offset + len(token)], token, (i, lp))
                    if i + 1 < NEW_TOKENS:
                        self.assertEqual(lp["text_offset"][i + 1], offset + len(token), (i, lp))
                self.assertEqual("".join(lp["tokens"]), text)

    def test_bad_values_are_named(self):
        for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("min_p", 1.5),
                             ("min_tokens", NEW_TOKENS + 1), ("logit_bias", {"100000": 1}),
                             ("logit_bias", {"5": 101}), ("allowed_token_ids", [-1]), ("bad_words", [[]]),
                             ("bad_words", [[1, 100000]]), ("no_repeat_ngram_size", 65)):
            with self.subTest(field=field, value=value):
                body = {"model": self.model_name, "prompt": self.prompt, "max_tokens": NEW_TOKENS, field: value}
                status, answer = self.post("/v1/completions", body, expect_error=True)
                self.assertEqual(status, 400, answer)
                self.assertEqual(answer["error"]["param"], field, answer)
                self.assertIn(field, answer["error"]["message"], answer)
        with self.assertRaises(relgen_client.RelgenError) as e:
            self.grpc.generate(self.prompt, max_new_tokens=4, min_p=-0.5)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn("min_p", str(e.exception))

    def post(self, path, body, expect_error=False):
        request = urllib.request.Request(f"http://{self.server.http}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                answer = json.load(r)
                return (r.status, answer) if expect_error else answer
        except urllib.error.HTTPError as e:
            if not expect_error:
                raise
            return e.code, json.load(e)


class BloomControlsTest(ControlsTestBase, unittest.TestCase):
    cases_env, case_name, specials = "RELGEN_HF_CASES_DIR", "bloom-h3", [0, 1, 2, 3]  # <unk> <s> </s> <pad>

    @classmethod
    def load(cls, path):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        return model, Reference(model, False, model.config.eos_token_id)


class T5ControlsTest(ControlsTestBase, unittest.TestCase):
    cases_env, case_name, specials = "RELGEN_T5_CASES_DIR", "t5-v1_0", [0, 1, 2]  # <pad> </s> <unk>

    @classmethod
    def load(cls, path):
        model = T5ForConditionalGeneration.from_pretrained(path).eval()
        return model, Reference(model, True, model.config.eos_token_id, start=model.config.decoder_start_token_id)


if __name__ == "__main__":
    unittest.main(verbosity=2)
