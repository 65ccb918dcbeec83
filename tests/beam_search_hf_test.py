"""Beam search end to end against transformers' generate(num_beams=..., do_sample=False) on the tiny
Hugging Face BLOOM and T5 checkpoints (random weights, tools/make_hf_checkpoints.py and
tools/make_t5_checkpoints.py): the same returned sequences in the same order, their scores
(sequences_scores) within 1e-4, for every setting of num_beams, num_return_sequences,
length_penalty, early_stopping, no_repeat_ngram_size, min_tokens and max_new_tokens below; on
relgen-server (CPU) and relgen-server-emu (the CUDA backend on the SIMT emulator) when
RELGEN_SERVER_EMU_BIN is set.

Run by CTest with the build-hf-venv python; RELGEN_SERVER_BIN, RELGEN_HF_CASES_DIR and
RELGEN_T5_CASES_DIR set."""
import json
import os
import sys
import unittest
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from openai_api_test import Server, relgen_client  # noqa: E402  (stubs and the client from the source tree)
from sampling_controls_test import _case  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
import transformers.generation.utils as generation_utils  # noqa: E402

# torch 1.13's torch.distributed.fsdp does not import on Python 3.11, and generate() asks it only
# whether the model is FSDP-wrapped (it is not).
generation_utils.is_fsdp_managed_module = lambda module: False

# (num_beams, num_return_sequences, length_penalty, early_stopping, no_repeat_ngram_size,
#  min_tokens, max_new_tokens, prompt index, logit bias of the end token). The bias makes the random
#  models end beams early enough that hypotheses, early stopping and the length penalty decide.
SETTINGS = [
    (2, 1, 1.0, False, 0, 0, 12, 0, 0.0),
    (2, 2, 1.0, True, 0, 0, 10, 1, 3.0),
    (3, 3, 1.0, "never", 0, 0, 12, 2, 3.0),
    (4, 2, 1.0, False, 0, 0, 16, 0, 3.0),
    (4, 4, 0.0, False, 0, 0, 14, 1, 4.0),
    (4, 1, 2.0, True, 0, 0, 14, 2, 4.0),
    (4, 3, -0.5, "never", 0, 0, 10, 0, 4.0),
    (5, 5, 1.0, False, 2, 0, 16, 1, 0.0),
    (3, 2, 1.0, True, 3, 0, 18, 2, 3.5),
    (8, 4, 1.0, False, 0, 0, 12, 0, 2.5),
    (6, 3, 0.5, "never", 2, 0, 12, 1, 3.5),
    (4, 2, 1.0, False, 0, 6, 12, 2, 4.0),
    (16, 16, 1.0, False, 0, 0, 8, 0, 3.0),
    (4, 4, 2.0, False, 0, 0, 14, 1, 3.0),
    (4, 4, 1.0, True, 0, 0, 14, 2, 5.0),
]


class BeamTestBase:
    emu = False

    @classmethod
    def setUpClass(cls):
        case = _case(os.environ[cls.cases_env], cls.case_name)
        cls.model = cls.load(case["dir"])
        cls.eos = cls.model.config.eos_token_id
        ids = case["text_ids"]
        cls.prompts = [ids[:7], ids[3:15], ids[10:13]]
        binary = os.environ["RELGEN_SERVER_BIN"]
        if cls.emu:
            emu = os.environ.get("RELGEN_SERVER_EMU_BIN")
            if not emu:
                raise unittest.SkipTest("RELGEN_SERVER_EMU_BIN unset")
            os.environ["RELGEN_SERVER_BIN"] = emu
        try:
            flags = ("--device", "cuda", "--weights_dtype", "f32", "--kv_cache_dtype", "f32") if cls.emu else ()
            cls.server = Server(*flags, model=case["dir"])
        finally:
            os.environ["RELGEN_SERVER_BIN"] = binary
        cls.grpc = relgen_client.Client(cls.server.grpc, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.grpc.close()
        cls.server.stop()

    def reference(self, prompt, k, ret, lp, early, ngram, min_tokens, max_new, eos_bias):
        kwargs = dict(num_beams=k, num_return_sequences=ret, length_penalty=lp, early_stopping=early,
                      no_repeat_ngram_size=ngram, max_new_tokens=max_new, do_sample=False,
                      output_scores=True, return_dict_in_generate=True)
        if min_tokens:
            kwargs["min_new_tokens"] = min_tokens
        if eos_bias:
            kwargs["sequence_bias"] = {(self.eos,): eos_bias}
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), **kwargs)
        skip = 1 if self.encoder_decoder else len(prompt)
        seqs = []
        for row in out.sequences.tolist():
            gen = row[skip:]
            # A beam never continues past the end token: the first one ends the sequence; after it, padding.
            if self.eos in gen:
                gen = gen[:gen.index(self.eos) + 1]
            seqs.append(gen)
        return seqs, out.sequences_scores.tolist()

    def test_settings_match_transformers(self):
        for setting in SETTINGS:
            k, ret, lp, early, ngram, min_tokens, max_new, which, eos_bias = setting
            prompt = self.prompts[which]
            with self.subTest(setting=setting):
                want, want_scores = self.reference(prompt, *setting[:7], eos_bias)
                got = self.grpc.generate(prompt, num_beams=k, num_return_sequences=ret, length_penalty=lp,
                                         early_stopping=early, no_repeat_ngram_size=ngram or None,
                                         min_tokens=min_tokens or None, max_new_tokens=max_new,
                                         logit_bias={self.eos: eos_bias} if eos_bias else None)
                self.assertEqual([s.token_ids for s in got.samples], want)
                for s, w in zip(got.samples, want_scores):
                    self.assertAlmostEqual(s.beam_score, w, delta=1e-4)
                self.assertEqual(got.beam_score, got.samples[0].beam_score)
                for s, w in zip(got.samples, want):
                    self.assertEqual(s.finish_reason, "eos" if w and w[-1] == self.eos else "length")

    def test_stream_sends_each_sequence_whole(self):
        setting = SETTINGS[3]
        k, ret, lp, early, ngram, min_tokens, max_new, which, eos_bias = setting
        want, want_scores = self.reference(self.prompts[which], *setting[:7], eos_bias)
        chunks = list(self.grpc.stream(self.prompts[which], num_beams=k, num_return_sequences=ret,
                                       max_new_tokens=max_new, logit_bias={self.eos: eos_bias}))
        self.assertEqual(len(chunks), ret)
        by_index = {c.sample_index: c for c in chunks}
        self.assertEqual([by_index[i].token_ids for i in range(ret)], want)
        for i in range(ret):
            self.assertIsNotNone(by_index[i].finish_reason)
            self.assertAlmostEqual(by_index[i].beam_score, want_scores[i], delta=1e-4)

    def test_openai_api_choices_are_the_sequences(self):
        # /v1/completions with num_beams: n is the number of sequences, the choices best first.
        setting = SETTINGS[9]
        k, ret, lp, early, ngram, min_tokens, max_new, which, eos_bias = setting
        want, _ = self.reference(self.prompts[which], *setting[:7], eos_bias)
        with urllib.request.urlopen(f"http://{self.server.http}/v1/models", timeout=60) as r:
            model = json.load(r)["data"][0]["id"]
        body = {"model": model, "prompt": self.prompts[which], "max_tokens": max_new, "n": ret, "num_beams": k,
                "length_penalty": lp, "early_stopping": early, "logit_bias": {str(self.eos): eos_bias}}
        req = urllib.request.Request(f"http://{self.server.http}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choices = json.load(r)["choices"]
        grpc_texts = [s.text for s in self.grpc.generate(
            self.prompts[which], num_beams=k, num_return_sequences=ret, length_penalty=lp, early_stopping=early,
            max_new_tokens=max_new, logit_bias={self.eos: eos_bias}).samples]
        self.assertEqual(len(choices), len(want))
        self.assertEqual([c["text"] for c in sorted(choices, key=lambda c: c["index"])], grpc_texts)
        self.assertEqual([c["finish_reason"] for c in sorted(choices, key=lambda c: c["index"])],
                         ["stop" if w[-1] == self.eos else "length" for w in want])

    def test_refusals_name_the_field(self):
        for params, field in ((dict(num_beams=17), "num_beams"), (dict(num_beams=2, num_return_sequences=3), "num_return_sequences"),
                              (dict(num_beams=2, n=2), "n"), (dict(num_beams=2, logprobs=1), "logprobs"),
                              (dict(num_beams=2, repetition_penalty=1.2), "repetition_penalty"),
                              (dict(num_beams=2, stop=["a"]), "stop"), (dict(num_beams=2, length_penalty=1000.0), "length_penalty")):
            with self.subTest(params=params):
                with self.assertRaises(relgen_client.RelgenError) as e:
                    self.grpc.generate(self.prompts[0], max_new_tokens=4, **params)
                self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
                self.assertIn(field, e.exception.details)


class BloomBeamTest(BeamTestBase, unittest.TestCase):
    cases_env, case_name, encoder_decoder = "RELGEN_HF_CASES_DIR", "bloom-h3", False

    @staticmethod
    def load(d):
        return transformers.AutoModelForCausalLM.from_pretrained(d).eval()


class T5BeamTest(BeamTestBase, unittest.TestCase):
    cases_env, case_name, encoder_decoder = "RELGEN_T5_CASES_DIR", "t5-v1_0", True

    @staticmethod
    def load(d):
        return transformers.T5ForConditionalGeneration.from_pretrained(d).eval()


class BloomBeamEmuTest(BloomBeamTest):
    emu = True


class T5BeamEmuTest(T5BeamTest):
    emu = True


if __name__ == "__main__":
    unittest.main(verbosity=2)
