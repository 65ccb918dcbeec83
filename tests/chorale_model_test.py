"""A chorale model served by relgen against the PyTorch that trained it (run by CTest with the music
venv's python; RELGEN_CHORALE_DATA, RELGEN_CHORALE_MODEL (tools/train_chorales.py's export, with its
training.json), RELGEN_SERVER_BIN and RELGEN_CLIENT_BIN set).

- Score's NLL per token of every test chorale (context BOS, continuation the rest and EOS) equals the
  trainer's PyTorch NLL of that chorale within 1e-4: the model's words, the skew or Shaw logits and
  the export are what the trainer computed.
- relgen-client generate --midi_in (a test chorale's first bars) --midi_out: 256 sampled steps after
  the prompt, written as four named tracks that mido and tools/chorales.py read back, the prompt's
  notes unchanged.
- --harmonize: a test chorale's soprano alone in, four voices out, the soprano as it was and every
  step filled.
- tools/render_chorale.py draws that file's piano roll as a PNG.
- client/python/examples/chorale.py (RELGEN_PYCLIENT_PYTHON: a python with relgen_client and mido)
  streams a continuation of a MIDI prompt into a MIDI file, the prompt's notes unchanged.

With RELGEN_CHORALE_SHIPPED=1 (models/chorales, a trained model) also what it makes is music of the
data's kind: continuations of 256 steps sampled at temperature 1 (five seeds) from each of three test
chorales' first bars have a median NLL per token under the model (Score) within the range of the test
chorales' NLLs, neither degenerate (far below: a repeated step) nor noise (far above); the MIDI each
writes reads back with mido as four voices, each sounding in the continuation, and at most 1% of the
sampled notes lie outside their voice's range over the training chorales in every transposition the
model was trained on."""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SOURCE, "tools"))
import chorales  # noqa: E402
import mido  # noqa: E402

DATA = os.environ["RELGEN_CHORALE_DATA"]
SHIPPED = os.environ.get("RELGEN_CHORALE_SHIPPED") == "1"
MODEL = os.environ["RELGEN_CHORALE_MODEL"]
CLIENT = os.environ["RELGEN_CLIENT_BIN"]


def as_midi_reads(grid):
    """The grid as a MIDI file of it reads back: a hold where nothing sounds is silence (sampled text
    can hold a voice after its rest), and the file ends with its last note."""
    out = [list(step) for step in grid]
    for i in range(1, len(out)):
        out[i] = ["R" if t == "H" and out[i - 1][v] == "R" else t for v, t in enumerate(out[i])]
    while out and all(t == "R" for t in out[-1]):
        out.pop()
    return out


class ChoraleModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(MODEL, "training.json")) as f:
            cls.training = json.load(f)
        with open(os.path.join(DATA, "test.jsonl")) as f:
            cls.test = [json.loads(line) for line in f]
        cls.tmp = tempfile.TemporaryDirectory()
        cls.server = subprocess.Popen(
            [os.environ["RELGEN_SERVER_BIN"], "--model", MODEL, "--listen", "127.0.0.1:0", "--metrics_listen",
             "127.0.0.1:0", "--kv_cache_tokens", "16384"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in cls.server.stdout:
            m = re.search(r"gRPC on (127\.0\.0\.1:\d+)", line)
            if m:
                cls.address = m.group(1)
                break
        else:
            raise RuntimeError("relgen-server did not start")

    @classmethod
    def tearDownClass(cls):
        cls.server.terminate()
        cls.server.wait(timeout=30)
        cls.tmp.cleanup()

    def client(self, *args):
        r = subprocess.run([CLIENT, *args, "--server", self.address], capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r

    def test_score_nll_equals_pytorch_on_the_test_split(self):
        want = self.training["test_nll_per_chorale"]
        self.assertEqual(sorted(want), sorted(i["name"] for i in self.test))
        total, count = 0.0, 0
        for item in self.test:
            words = chorales.tokens_of_grid(item["grid"])
            # The context is the model's BOS as a token id: a text context would get the server's BOS first.
            r = self.client("score", "--json", "--context_token_ids", str(chorales.IDS[words[0]]), "--continuation",
                            " ".join(words[1:]))
            score = json.loads(r.stdout)["scores"][0]
            n = len(score["logprobs"])
            self.assertEqual(n, len(words) - 1, item["name"])
            nll = -score["sum_logprob"] / n
            self.assertAlmostEqual(nll, want[item["name"]], delta=1e-4, msg=item["name"])
            total, count = total - score["sum_logprob"], count + n
        self.assertAlmostEqual(total / count, self.training["test_nll_per_token"], delta=1e-4)

    def test_midi_prompt_to_midi_continuation(self):
        # Four bars of 4/4 that do not end in silence (a MIDI file cannot hold trailing rests).
        grid = next(i["grid"][:64] for i in self.test if any(t != "R" for t in i["grid"][63]))
        prompt = os.path.join(self.tmp.name, "prompt.mid")
        out = os.path.join(self.tmp.name, "out.mid")
        chorales.write_midi(grid, prompt)
        musical = ",".join(str(chorales.IDS[w]) for w in chorales.VOCAB if w not in ("PAD", "BOS", "EOS"))
        r = self.client("generate", "--midi_in", prompt, "--midi_out", out, "--max_new_tokens", str(4 * 256),
                        "--temperature", "1", "--seed", "3", "--allowed_token_ids", musical, "--stream")
        # The words as the client reads them (each the cell of the voice it names), MIDI's view of them.
        want = chorales.grid_of_tokens(chorales.tokens_of_grid(grid)[1:-1] + r.stdout.split())
        self.assertIn(f"{len(want)} steps of four voices, 64 from the prompt", r.stderr)
        self.assertGreaterEqual(len(want), 64 + 255)  # 1024 words: at most four a step
        f = mido.MidiFile(out)
        self.assertEqual([[m.name for m in t if m.type == "track_name"] for t in f.tracks],
                         [[v] for v in chorales.VOICES])
        back = chorales.read_midi(out)
        self.assertEqual(back, as_midi_reads(want))
        # The prompt's notes as they were: every voice's notes that end within the prompt.
        for v, (got, want) in enumerate(zip(chorales.notes_of_grid(back), chorales.notes_of_grid(grid))):
            inside = [n for n in want if n[0] + n[1] < 64]
            self.assertEqual([n for n in got if n[0] + n[1] < 64], inside, chorales.VOICES[v])
        # The piano roll of it (tools/render_chorale.py; the WAV needs FluidSynth, which only serve installs).
        png = os.path.join(self.tmp.name, "out.png")
        r = subprocess.run([sys.executable, os.path.join(SOURCE, "tools", "render_chorale.py"), out, "--prompt_steps",
                            "64", "--png", png, "--wav", "none"], capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(f"({len(back)} steps)", r.stdout)
        with open(png, "rb") as f:
            head = f.read(24)
        self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
        self.assertGreater(int.from_bytes(head[16:20], "big"), 100)  # width in pixels

    def test_harmonize_keeps_the_melody(self):
        grid = self.test[1]["grid"][:48]
        while grid[-1][0] == "R":  # the melody's file ends with its last note
            grid = grid[:-1]
        melody = [[step[0], "R", "R", "R"] for step in grid]
        path = os.path.join(self.tmp.name, "melody.mid")
        out = os.path.join(self.tmp.name, "harmonized.mid")
        chorales.write_midi(melody, path)
        r = self.client("generate", "--midi_in", path, "--harmonize", "--midi_out", out, "--temperature", "1",
                        "--seed", "5")
        back = chorales.read_midi(out)
        self.assertEqual([step[0] for step in back], [step[0] for step in grid], r.stdout)
        words = r.stdout.split()
        self.assertEqual(len(words), 4 * len(grid))
        self.assertTrue(all(w in chorales.IDS and w not in ("PAD", "BOS", "EOS") for w in words))

    def test_python_example(self):
        grid = self.test[2]["grid"][:32]
        while all(t == "R" for t in grid[-1]):
            grid = grid[:-1]
        prompt = os.path.join(self.tmp.name, "example-prompt.mid")
        out = os.path.join(self.tmp.name, "example-out.mid")
        chorales.write_midi(grid, prompt)
        example = os.path.join(SOURCE, "client", "python", "examples", "chorale.py")
        r = subprocess.run([os.environ["RELGEN_PYCLIENT_PYTHON"], example, prompt, out, "--server", self.address,
                            "--steps", "40", "--seed", "2"], capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(len(r.stdout.splitlines()), 40 + 1, r.stdout)  # a line per step, then the summary
        back = chorales.read_midi(out)
        words = chorales.tokens_of_grid(grid)[1:-1] + r.stdout.split()[: 4 * 40]
        self.assertEqual(back, as_midi_reads(chorales.grid_of_tokens(words)))
        for v, (got, want) in enumerate(zip(chorales.notes_of_grid(back), chorales.notes_of_grid(grid))):
            inside = [n for n in want if n[0] + n[1] < len(grid)]
            self.assertEqual([n for n in got if n[0] + n[1] < len(grid)], inside, chorales.VOICES[v])

    @unittest.skipUnless(SHIPPED, "quality of a trained model: RELGEN_CHORALE_SHIPPED=1 (models/chorales)")
    def test_sampled_continuation_is_music_of_the_data_kind(self):
        with open(os.path.join(DATA, "train.jsonl")) as f:
            train = [json.loads(line)["grid"] for line in f]
        # Each voice's range over the training chorales, widened by the transpositions trained on.
        lo, hi = [99] * 4, [0] * 4
        for grid in train:
            for step in grid:
                for v, t in enumerate(step):
                    if t.startswith("P"):
                        lo[v], hi[v] = min(lo[v], int(t[1:])), max(hi[v], int(t[1:]))
        lo = [max(chorales.LOW, x + min(chorales.SHIFTS)) for x in lo]
        hi = [min(chorales.HIGH, x + max(chorales.SHIFTS)) for x in hi]
        per_chorale = self.training["test_nll_per_chorale"].values()
        low, high = min(per_chorale), max(per_chorale)
        # Grid words only: a chorale of 64 + 256 steps is longer than most, so EOS would come early.
        musical = ",".join(str(chorales.IDS[w]) for w in chorales.VOCAB if w not in ("PAD", "BOS", "EOS"))
        notes, outside = 0, []
        for item in self.test[:3]:
            with self.subTest(chorale=item["name"]):
                grid = item["grid"][:64]  # four bars of 4/4
                while all(t == "R" for t in grid[-1]):
                    grid = grid[:-1]
                prompt = os.path.join(self.tmp.name, "shipped-prompt.mid")
                chorales.write_midi(grid, prompt)
                context = [chorales.IDS["BOS"]] + [chorales.IDS[w] for w in chorales.tokens_of_grid(grid)[1:-1]]
                # One sample can wander anywhere; the median of five says what the model makes.
                nlls = []
                for seed in range(11, 16):
                    out = os.path.join(self.tmp.name, f"shipped-out-{seed}.mid")
                    r = self.client("generate", "--midi_in", prompt, "--midi_out", out, "--max_new_tokens",
                                    str(4 * 256), "--temperature", "1", "--seed", str(seed), "--allowed_token_ids",
                                    musical)
                    words = r.stdout.split()
                    self.assertEqual(len(words), 4 * 256, r.stderr)
                    s = json.loads(self.client("score", "--json", "--context_token_ids", ",".join(map(str, context)),
                                               "--continuation", " ".join(words)).stdout)["scores"][0]
                    nlls.append(-s["sum_logprob"] / len(s["logprobs"]))
                    f = mido.MidiFile(out)
                    self.assertEqual(len([t for t in f.tracks if any(m.type == "note_on" for m in t)]), 4)
                    back = chorales.read_midi(out)
                    self.assertEqual(back, as_midi_reads(chorales.grid_of_tokens(chorales.tokens_of_grid(grid)[1:-1] +
                                                                                 words)))
                    self.assertGreaterEqual(len(back), len(grid) + 200)
                    for v, voice in enumerate(chorales.notes_of_grid(back)):
                        sampled = [n[2] for n in voice if n[0] >= len(grid)]
                        self.assertTrue(sampled, (seed, chorales.VOICES[v]))
                        notes += len(sampled)
                        outside += [(item["name"], seed, chorales.VOICES[v], p) for p in sampled if not lo[v] <= p <= hi[v]]
                nll = sorted(nlls)[len(nlls) // 2]
                shown = " ".join(f"{x:.4f}" for x in nlls)
                self.assertGreaterEqual(nll, low, f"median {nll:.4f} ({shown}) below the test chorales' {low:.4f}..{high:.4f}")
                self.assertLessEqual(nll, high, f"median {nll:.4f} ({shown}) above the test chorales' {low:.4f}..{high:.4f}")
        # A small model's voice can stray late in a long continuation; rarely.
        self.assertLessEqual(len(outside), 0.01 * notes, f"{len(outside)} of {notes} sampled notes: {outside}")


if __name__ == "__main__":
    unittest.main()
