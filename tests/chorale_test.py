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


if __name__ == "__main__":
    unittest.main()
