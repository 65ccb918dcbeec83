#!/usr/bin/python3
"""A chorale MIDI file (relgen-client --midi_out, tools/chorales.py) as a piano roll PNG and a WAV.

  build-music-venv/bin/python tools/render_chorale.py OUT.mid [--prompt_steps N] [--png OUT.png] [--wav OUT.wav]

The piano roll: time in sixteenth-note steps across, pitch up, one colour per voice (soprano, alto,
tenor, bass), a line where the prompt ends (--prompt_steps; relgen-client prints it as "N from the
prompt"). The WAV: FluidSynth (Debian's fluidsynth) with the General MIDI soundfont
(fluid-soundfont-gm), 44.1 kHz. Needs matplotlib and mido (build-music-venv)."""
import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chorales  # noqa: E402

SOUNDFONT = "/usr/share/sounds/sf2/FluidR3_GM.sf2"
COLOURS = ("#c0392b", "#2980b9", "#27ae60", "#8e44ad")


def piano_roll(grid, png, prompt_steps=0, title=""):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    voices = chorales.notes_of_grid(grid)
    pitches = [m for v in voices for _, _, m in v] or [60]
    steps = max(len(grid), 1)
    fig, ax = plt.subplots(figsize=(min(4 + steps / 16, 40), 4.5), dpi=100)
    for i, notes in enumerate(voices):
        for on, length, midi in notes:
            ax.add_patch(plt.Rectangle((on, midi - 0.4), length - 0.1, 0.8, color=COLOURS[i], lw=0,
                                       label=chorales.VOICES[i] if (on, length, midi) == notes[0] else None))
    if 0 < prompt_steps < steps:
        ax.axvline(prompt_steps, color="black", lw=1, ls="--")
        ax.text(prompt_steps, max(pitches) + 2, " generated from here", va="bottom", fontsize=8)
    ax.set_xlim(0, steps)
    ax.set_ylim(min(pitches) - 2, max(pitches) + 5)
    ax.set_xticks(range(0, steps + 1, 16))
    ax.set_xlabel("sixteenth-note steps (a bar of 4/4 every 16)")
    ax.set_ylabel("MIDI pitch")
    ax.grid(axis="x", color="#dddddd", lw=0.5)
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def wav(mid, out, soundfont=SOUNDFONT):
    if shutil.which("fluidsynth") is None or not os.path.exists(soundfont):
        raise SystemExit(f"rendering a WAV needs fluidsynth and {soundfont} (apt install fluidsynth fluid-soundfont-gm)")
    subprocess.run(["fluidsynth", "-ni", "-q", "-F", out, "-r", "44100", soundfont, mid], check=True,
                   stdout=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("midi")
    ap.add_argument("--prompt_steps", type=int, default=0)
    ap.add_argument("--png", default="", help="default: the MIDI file's name with .png")
    ap.add_argument("--wav", default="", help="default: the MIDI file's name with .wav; 'none' for no WAV")
    a = ap.parse_args()
    base = a.midi.rsplit(".", 1)[0]
    grid = chorales.read_midi(a.midi)
    png = a.png or base + ".png"
    piano_roll(grid, png, a.prompt_steps, os.path.basename(a.midi))
    print(f"wrote {png} ({len(grid)} steps)")
    if a.wav != "none":
        out = a.wav or base + ".wav"
        wav(a.midi, out)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
