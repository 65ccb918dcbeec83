"""The chorale grid end to end, against tools/chorales.py and mido (run by CTest with the music venv's
python; RELGEN_CHORALE_DATA is tools/chorales.py build's folder, RELGEN_CLIENT_BIN the C++ client).

- Every chorale of the split: grid -> MIDI (tools/chorales.py) -> grid is exact, and so are
  words -> MIDI (relgen-client midi --midi_out) -> grid (tools/chorales.py, mido) and
  MIDI (tools/chorales.py) -> words (relgen-client midi --midi_in): the C++ reader and writer against
  the Python ones, notes and timing.
- The files relgen-client writes are four named tracks, one voice each, every pitch in that voice's
  range over the corpus."""
import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(SOURCE, "tools"))
import chorales  # noqa: E402
import mido  # noqa: E402

DATA = os.environ["RELGEN_CHORALE_DATA"]
CLIENT = os.environ["RELGEN_CLIENT_BIN"]


def items():
    with open(os.path.join(SOURCE, "models", "chorales", "split.json")) as f:
        split = json.load(f)
    out = []
    for part in ("train", "validation", "test"):
        with open(os.path.join(DATA, f"{part}.jsonl")) as f:
            got = [json.loads(line) for line in f]
        assert [g["name"] for g in got] == split[part], f"{part}.jsonl is not the split's {part} list"
        out += got
    return out


class ChoraleGridTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.items = items()
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def client(self, *args, text=None):
        r = subprocess.run([CLIENT, "midi", *args], input=text, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        return r.stdout

    def test_the_split_is_every_usable_chorale(self):
        self.assertGreaterEqual(len(self.items), 350)
        names = [i["name"] for i in self.items]
        self.assertEqual(len(names), len(set(names)))

    def test_every_chorale_round_trips_through_both_sides(self):
        lo, hi = [99] * 4, [0] * 4
        for item in self.items:
            grid = item["grid"]
            for step in grid:
                for v, t in enumerate(step):
                    if t.startswith("P"):
                        lo[v], hi[v] = min(lo[v], int(t[1:])), max(hi[v], int(t[1:]))
        self.assertTrue(all(lo[v] < hi[v] for v in range(4)))
        for item in self.items:
            with self.subTest(chorale=item["name"]):
                grid = item["grid"]
                words = " ".join(chorales.tokens_of_grid(grid)[1:-1])  # the steps: no BOS (the server adds it), no EOS
                py_mid = os.path.join(self.tmp.name, "py.mid")
                chorales.write_midi(grid, py_mid)
                self.assertEqual(chorales.read_midi(py_mid), grid)
                self.assertEqual(self.client("--midi_in", py_mid).strip(), words)
                cc_mid = os.path.join(self.tmp.name, "cc.mid")
                self.client("--midi_out", cc_mid, text=words)
                self.assertEqual(chorales.read_midi(cc_mid), grid)
                f = mido.MidiFile(cc_mid)
                self.assertEqual(len(f.tracks), 4)
                for v, track in enumerate(f.tracks):
                    names = [m.name for m in track if m.type == "track_name"]
                    self.assertEqual(names, [chorales.VOICES[v]])
                    notes = [m.note for m in track if m.type == "note_on" and m.velocity > 0]
                    self.assertTrue(all(lo[v] <= n <= hi[v] for n in notes), (v, lo[v], hi[v]))
                    self.assertTrue(all(m.channel == v for m in track if not m.is_meta))

    def test_skipped_words_read_alike_on_both_sides(self):
        # Sampled text can skip a voice's word; the C++ reader (relgen-client midi --midi_out) and
        # chorales.grid_of_tokens read the same words to the same grid, and it is the hand-derived one.
        hand = "S:P60 A:P55 T:R B:P36 S:H A:H T:P52 S:P62 A:P57 T:H B:H B:P38 A:R A:H S:R T:R B:R".split()
        self.assertEqual(chorales.grid_of_tokens(hand),
                         [["P60", "P55", "R", "P36"], ["H", "H", "P52", "H"], ["P62", "P57", "H", "H"],
                          ["H", "H", "H", "P38"], ["H", "R", "H", "H"], ["H", "H", "H", "H"], ["R", "H", "R", "R"]])
        rng = random.Random(5)
        for item in self.items[:40]:
            with self.subTest(chorale=item["name"]):
                full = chorales.tokens_of_grid(item["grid"])[1:-1]
                kept = [i for i in range(len(full)) if rng.random() > 0.05]
                words = [full[i] for i in kept]
                grid = chorales.grid_of_tokens(words)
                # Every step keeps its place; the last goes only with its bass word.
                self.assertEqual(len(grid), len(item["grid"]) - (kept[-1] != len(full) - 1))
                self.assertNotEqual(grid, item["grid"][: len(grid)])
                # A hold where nothing sounds (a soprano word dropped from the first step, then its
                # hold) is silence in MIDI; and a MIDI file ends with its last note.
                for i in range(1, len(grid)):
                    grid[i] = ["R" if t == "H" and grid[i - 1][v] == "R" else t for v, t in enumerate(grid[i])]
                while grid and all(t == "R" for t in grid[-1]):
                    grid.pop()
                cc_mid = os.path.join(self.tmp.name, "skipped.mid")
                self.client("--midi_out", cc_mid, text=" ".join(words))
                self.assertEqual(chorales.read_midi(cc_mid), grid)


if __name__ == "__main__":
    unittest.main()
