"""lm-eval (EleutherAI's evaluation harness, pinned in the test venv) run unchanged against relgen's
/v1/completions, as users run it: local-completions at num_concurrent 1 (requests) and 4 (aiohttp,
which offers Brotli wherever a brotli module imports, Debian's 1.0.9 here) against relgen-server
serving the tiny float32 BLOOM checkpoint, and lm-eval's own hf backend (transformers) on the same
checkpoint as the reference. Three local tasks made here from the fortunes text: multiple choice
(loglikelihood), rolling perplexity over windows of 48 tokens (loglikelihood_rolling) and
generate_until with stop strings. Per-item log-likelihoods agree within 1e-4 and generations are
equal.

Run by CTest with the build-hf-venv python; RELGEN_SERVER_BIN and RELGEN_HF_CASES_DIR set."""
import json
import math
import os
import random
import sys
import tempfile
import unittest

# Everything is local: the tasks' data files and the checkpoint. Nothing may be fetched.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import hf_testdata  # noqa: E402  (Debian's fortunes, as the checkpoints' tokenizers were trained on)
from openai_api_test import Server  # noqa: E402
from sampling_controls_test import _case, _model_id  # noqa: E402

import transformers.generation.utils as generation_utils  # noqa: E402

# torch 1.13's torch.distributed.fsdp does not import on Python 3.11, and generate() asks it only
# whether the model is FSDP-wrapped (it is not).
generation_utils.is_fsdp_managed_module = lambda module: False

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TOLERANCE = 1e-4
WINDOW = 48  # tokens per rolling window, so a document spans several
TASKS = ["relgen_fortunes_mc", "relgen_fortunes_ppl", "relgen_fortunes_gen"]


def read_fortunes():
    texts = [t.strip() for t in hf_testdata.fortunes()]
    # Plain ASCII prose of a few sentences: long enough to split, short enough to stay quick.
    return [t for t in texts if 80 <= len(t) <= 400 and t.isascii() and len(t.split()) >= 12]


def write_tasks(folder):
    """The three tasks' data (JSON lines) and their YAML files, the same every run."""
    fortunes = read_fortunes()
    if len(fortunes) < 40:
        raise RuntimeError(f"the fortunes hold {len(fortunes)} usable texts; the tasks need 40")
    rng = random.Random(20261128)
    picked = rng.sample(fortunes, 40)

    def halves(text):
        # Endings of 5 words: a choice fits one window; the context before it is cut to the window.
        words = text.split()
        return " ".join(words[:-5]), " ".join(words[-5:])

    mc = []
    for i in range(12):
        context, ending = halves(picked[i])
        others = [halves(picked[12 + (i + j) % 12])[1] for j in range(3)]
        choices = others + [ending]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "label": choices.index(ending)})
    ppl = [{"text": t} for t in sorted(picked[24:30], key=len, reverse=True)]
    gen = [{"context": " ".join(t.split()[:5]), "answer": " ".join(t.split()[5:])} for t in picked[30:38]]
    data = {"mc": mc, "ppl": ppl, "gen": gen}
    for name, docs in data.items():
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for d in docs:
                f.write(json.dumps(d) + "\n")

    def dataset(name):
        return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": os.path.join(folder, f"{name}.jsonl")}},
                "test_split": "test"}

    tasks = {
        "relgen_fortunes_mc": dict(dataset("mc"), output_type="multiple_choice", doc_to_text="{{context}}",
                                   doc_to_choice="{{choices}}", doc_to_target="{{label}}", target_delimiter=" ",
                                   metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]),
        "relgen_fortunes_ppl": dict(dataset("ppl"), output_type="loglikelihood_rolling", doc_to_text="",
                                    doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity", "aggregation": "weighted_perplexity",
                                                                  "higher_is_better": False}]),
        "relgen_fortunes_gen": dict(dataset("gen"), output_type="generate_until", doc_to_text="{{context}}",
                                    doc_to_target="{{answer}}", target_delimiter=" ",
                                    generation_kwargs={"until": [".", "\n"], "max_gen_toks": 16, "do_sample": False},
                                    metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]),
    }
    for name, spec in tasks.items():
        # JSON is YAML: no YAML writer needed.
        with open(os.path.join(folder, f"{name}.yaml"), "w") as f:
            json.dump(dict(task=name, **spec), f, indent=1)
    return data


def per_item(results):
    """Each task's responses in document order: log-likelihoods as floats, generations as text."""
    out = {}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        items = []
        for s in samples:
            for resp in s["resps"]:
                value = resp[0]
                if isinstance(value, (list, tuple)):  # (log-likelihood, is_greedy)
                    value = value[0]
                items.append(value)
        out[task] = items
    return out


class LmEvalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        case = _case(os.environ["RELGEN_HF_CASES_DIR"], "bloom-h12")
        cls.checkpoint = case["dir"]
        cls.folder = tempfile.mkdtemp(prefix="relgen-lm-eval-")
        cls.data = write_tasks(cls.folder)
        cls.task_manager = TaskManager(include_path=cls.folder)
        cls.server = Server("--max_num_seqs", "8", model=cls.checkpoint)
        try:
            cls.served = _model_id(cls.server)
            cls.reference = cls.evaluate("hf", f"pretrained={cls.checkpoint},dtype=float32,device=cpu,max_length={WINDOW}")
        except BaseException:
            cls.server.stop()  # tearDownClass does not run after a failed setUpClass
            raise

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    @classmethod
    def evaluate(cls, model, model_args):
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                          task_manager=cls.task_manager, num_fewshot=0, batch_size=1,
                                          log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                          fewshot_random_seed=0)
        if results is None or "samples" not in results:
            raise RuntimeError(f"lm-eval returned no samples for {model}")
        return per_item(results)

    def test_the_reference_covers_every_document(self):
        # A task that silently dropped its documents would compare nothing below.
        ref = self.reference
        self.assertEqual(len(ref["relgen_fortunes_mc"]), sum(len(d["choices"]) for d in self.data["mc"]))
        self.assertEqual(len(ref["relgen_fortunes_ppl"]), len(self.data["ppl"]))
        self.assertEqual(len(ref["relgen_fortunes_gen"]), len(self.data["gen"]))
        for task in TASKS[:2]:
            self.assertTrue(all(isinstance(v, float) and math.isfinite(v) and v < 0 for v in ref[task]), task)
        # Windows of 48 tokens: the longest document needs more than one.
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(self.checkpoint)
        self.assertGreater(len(tok(self.data["ppl"][0]["text"])["input_ids"]), 2 * WINDOW)
        # Generations say something, and at least one ends on a stop string before its 16 tokens.
        print("transformers' generations:", ref["relgen_fortunes_gen"], file=sys.stderr)
        self.assertTrue(any(g.strip() for g in ref["relgen_fortunes_gen"]))
        self.assertTrue(any(len(tok(g)["input_ids"]) < 16 for g in ref["relgen_fortunes_gen"]))

    def check_against_the_reference(self, concurrent):
        # lm-eval's API models keep max_length - 1 tokens (one is left for the generated token) and
        # roll windows of max_length - 2; its hf backend keeps max_length + 1 and rolls max_length.
        # WINDOW + 2 gives both the same windows and the same left-truncated contexts.
        got = self.evaluate("local-completions",
                            f"model={self.served},base_url={self.server.base_url}/completions,"
                            f"tokenizer={self.checkpoint},tokenizer_backend=huggingface,num_concurrent={concurrent},"
                            f"max_retries=1,max_length={WINDOW + 2},timeout=600")
        for task in TASKS[:2]:
            want = self.reference[task]
            self.assertEqual(len(got[task]), len(want), task)
            for i, (g, w) in enumerate(zip(got[task], want)):
                self.assertLessEqual(abs(g - w), TOLERANCE, f"{task} item {i}: relgen {g}, transformers {w}")
            worst = max(abs(g - w) for g, w in zip(got[task], want))
            print(f"num_concurrent {concurrent}, {task}: {len(want)} items, largest |relgen - transformers| "
                  f"{worst:.2e}", file=sys.stderr)
        self.assertEqual(got["relgen_fortunes_gen"], self.reference["relgen_fortunes_gen"])

    def test_one_request_at_a_time(self):
        self.check_against_the_reference(1)

    def test_four_at_once(self):
        self.check_against_the_reference(4)


if __name__ == "__main__":
    unittest.main(verbosity=2)
