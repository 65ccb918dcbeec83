"""Example: continue a four-voice chorale from a MIDI file with models/chorales.

  python3 examples/chorale.py PROMPT.mid OUT.mid [--server HOST:PORT] [--steps 128] [--seed 1]

The MIDI side is tools/chorales.py of the relgen source tree (it needs mido: pip install mido); the
model's words are its grid, a word per voice and sixteenth, soprano, alto, tenor, bass, each naming its
voice: S:P67 (a note starts), A:H (it goes on), T:R (silence).
The continuation streams in as words, a step (four words) at a time on one line."""
import argparse
import os
import sys

from relgen_client import Client

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))
import chorales  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt_midi")
    ap.add_argument("out_midi")
    ap.add_argument("--server", default="localhost:50051")
    ap.add_argument("--steps", type=int, default=128, help="sixteenth-note steps to add")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    prompt = chorales.read_midi(a.prompt_midi)
    words = chorales.tokens_of_grid(prompt)[1:-1]  # the steps: the server puts the model's BOS first; no EOS
    # Only grid words: no BOS, EOS or PAD in the middle of a piece.
    musical = [chorales.IDS[w] for w in chorales.VOCAB if w not in ("PAD", "BOS", "EOS")]
    out, pending = [], []
    with Client(a.server, timeout=600) as client:
        for chunk in client.stream(" ".join(words), max_new_tokens=4 * a.steps, temperature=a.temperature,
                                   seed=a.seed, allowed_token_ids=musical):
            pending += chunk.text.split()
            while len(pending) >= 4:
                step, pending = pending[:4], pending[4:]
                out += step
                print(" ".join(step), flush=True)
    grid = chorales.grid_of_tokens(words + out)
    chorales.write_midi(grid, a.out_midi)
    print(f"wrote {a.out_midi}: {len(grid)} steps, {len(prompt)} from the prompt")


if __name__ == "__main__":
    main()
