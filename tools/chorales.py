#!/usr/bin/python3
"""Bach's four-part chorales as Music Transformer's serialized grid, from music21's corpus.

  python tools/chorales.py build --out DIR [--split models/chorales/split.json]
  python tools/chorales.py split --out models/chorales/split.json   (the fixed split, written once)
  python tools/chorales.py roundtrip DIR                              (every chorale: grid -> MIDI -> grid)
  python tools/chorales.py prompt --chorale bwv103.6 --steps 64 --out prompt.mid
                                                   (a chorale's first steps as MIDI: a prompt)

The grid (the paper's JSB representation, section 4.1 of Huang et al. 2018): time in sixteenth
notes; at each step the four voices in the order soprano, alto, tenor, bass; per voice and step one
cell:

  P<midi>  a note of that MIDI pitch starts on this step
  H        the voice's note started earlier and still sounds (held, or tied over a bar line)
  R        the voice is silent

The model's token for a cell names its voice, S: A: T: B: (S:P67 A:H T:P59 B:R): with one token set
shared by the voices, a small relative-attention model loses track of which voice a token is for
(nothing in its input says where a step starts once every voice holds) and its voices wander into
each other's ranges. The data files hold the cells; tokens_of_grid makes the tokens.

A chorale is BOS, then 4 tokens per step, then EOS. A note's length is its onset step plus the H
steps after it, so a grid is the notes and their timing exactly for any score whose onsets and
durations fall on sixteenths (the chorales that do not are left out, and listed by `build`).

Vocabulary (VOCAB below; written to DIR/vocab.txt, one token per line, the line number its id):
PAD BOS EOS, then per voice S A T B: X:R X:H X:P24..X:P96 (303 tokens). Transposition for
augmentation shifts every pitch by -5..+6 semitones (the 12 keys, as the paper did for its JSB
models), skipping shifts that would leave P24..P96.

Needs music21 (PyPI) for `build`; mido (PyPI) for the MIDI side."""
import argparse
import json
import os
import random
import sys

PAD, BOS, EOS, REST, HOLD = "PAD", "BOS", "EOS", "R", "H"
LOW, HIGH = 24, 96
VOICES = ("soprano", "alto", "tenor", "bass")
LETTERS = ("S", "A", "T", "B")
CELLS = [REST, HOLD] + [f"P{m}" for m in range(LOW, HIGH + 1)]
VOCAB = [PAD, BOS, EOS] + [f"{letter}:{c}" for letter in LETTERS for c in CELLS]
IDS = {t: i for i, t in enumerate(VOCAB)}
STEP = 0.25  # quarter lengths per grid step: a sixteenth note
TICKS = 480  # MIDI ticks per quarter note in the files written here
STEP_TICKS = int(TICKS * STEP)
SHIFTS = range(-5, 7)


class NotOnGrid(Exception):
    pass


def voice_parts(score):
    """The soprano, alto, tenor and bass parts of a chorale score, or None (instrument parts, which
    some chorales add, are not voices)."""
    found = {}
    for part in score.parts:
        name = (part.partName or "").strip().lower()
        for v in VOICES:
            if name.startswith(v) and v not in found:
                found[v] = part
    return [found[v] for v in VOICES] if len(found) == 4 else None


def notes_of(part):
    """[(onset_step, length_steps, midi)] of one voice, ties merged; NotOnGrid if any onset or
    length is not a whole number of sixteenths or the voice sounds two notes at once."""
    out = []
    for n in part.flatten().notesAndRests:
        if n.isRest or n.duration.isGrace:  # grace notes are ornaments, not on the grid (as in JSB)
            continue
        if n.isChord:
            raise NotOnGrid("a chord in one voice")
        on, length = float(n.offset) / STEP, float(n.quarterLength) / STEP
        if on != int(on) or length != int(length) or length <= 0:
            raise NotOnGrid(f"a note at {n.offset} of {n.quarterLength} quarters")
        on, length = int(on), int(length)
        tie = n.tie.type if n.tie is not None else None
        if tie in ("stop", "continue") and out and out[-1][0] + out[-1][1] == on and out[-1][2] == n.pitch.midi:
            out[-1] = (out[-1][0], out[-1][1] + length, out[-1][2])
            continue
        if out and out[-1][0] + out[-1][1] > on:
            raise NotOnGrid("overlapping notes in one voice")
        out.append((on, length, n.pitch.midi))
    return out


def grid_of_notes(voices, steps=None):
    """Four voices' [(onset, length, midi)] -> [steps][4] tokens."""
    if steps is None:
        steps = max((on + length for v in voices for on, length, _ in v), default=0)
    grid = [[REST] * 4 for _ in range(steps)]
    for i, v in enumerate(voices):
        for on, length, midi in v:
            if not LOW <= midi <= HIGH:
                raise NotOnGrid(f"pitch {midi} outside P{LOW}..P{HIGH}")
            grid[on][i] = f"P{midi}"
            for s in range(on + 1, on + length):
                grid[s][i] = HOLD
    return grid


def notes_of_grid(grid):
    """[steps][4] tokens -> four voices' [(onset, length, midi)]; a stray H (no note sounding) is
    a rest."""
    voices = [[] for _ in range(4)]
    for s, step in enumerate(grid):
        for i, t in enumerate(step):
            if t.startswith("P"):
                voices[i].append([s, 1, int(t[1:])])
            elif t == HOLD and voices[i] and voices[i][-1][0] + voices[i][-1][1] == s:
                voices[i][-1][1] += 1
    return [[tuple(n) for n in v] for v in voices]


def tokens_of_grid(grid):
    return [BOS] + [f"{LETTERS[v]}:{c}" for step in grid for v, c in enumerate(step)] + [EOS]


def grid_of_tokens(tokens):
    """Tokens (BOS and EOS optional, PAD dropped) -> [steps][4] cells, as the client reads sampled words:
    each word is the cell of the voice it names; a word whose voice does not come after the previous
    word's begins the next step; a voice a step has no word for goes on as it was (H after a note or
    H, R after R); a trailing step without its bass word is dropped."""
    grid, step, last = [], [None] * 4, -1

    def close():
        for v in range(4):
            if step[v] is None:
                step[v] = "R" if not grid or grid[-1][v] == "R" else "H"
        grid.append(list(step))

    for t in tokens:
        if t == EOS:
            break
        if t in (PAD, BOS):
            continue
        voice, cell = LETTERS.index(t[0]), t.split(":", 1)[1]
        if voice <= last:
            close()
            step = [None] * 4
        step[voice], last = cell, voice
        if voice == 3:
            close()
            step, last = [None] * 4, -1
    return grid


def transpose(grid, shift):
    return [[f"P{int(t[1:]) + shift}" if t.startswith("P") else t for t in step] for step in grid]


def fits(grid, shift):
    pitches = [int(t[1:]) for step in grid for t in step if t.startswith("P")]
    return all(LOW <= p + shift <= HIGH for p in pitches)


# ---- MIDI (mido): one track per voice, soprano first, channel = voice index

def write_midi(grid, path, tempo_bpm=80, programs=(52, 52, 52, 52)):
    import mido

    f = mido.MidiFile(ticks_per_beat=TICKS)
    for i, notes in enumerate(notes_of_grid(grid)):
        track = mido.MidiTrack()
        f.tracks.append(track)
        track.append(mido.MetaMessage("track_name", name=VOICES[i], time=0))
        if i == 0:
            track.append(mido.MetaMessage("set_tempo", tempo=mido.bpm2tempo(tempo_bpm), time=0))
        track.append(mido.Message("program_change", channel=i, program=programs[i], time=0))
        events = []
        for on, length, midi in notes:
            events.append((on * STEP_TICKS, 1, midi))  # note_off before note_on at the same tick
            events.append(((on + length) * STEP_TICKS, 0, midi))
        events.sort(key=lambda e: (e[0], e[1]))
        now = 0
        for tick, kind, midi in events:
            msg = "note_on" if kind == 1 else "note_off"
            track.append(mido.Message(msg, channel=i, note=midi, velocity=80 if kind == 1 else 0, time=tick - now))
            now = tick
        track.append(mido.MetaMessage("end_of_track", time=0))
    f.save(path)


def read_midi(path):
    """A MIDI file -> [steps][4]: four tracks with notes (soprano first), or else one track's four
    channels 0-3; onsets and ends quantised to the nearest sixteenth."""
    import mido

    f = mido.MidiFile(path)
    per_track = []
    for track in f.tracks:
        now, sounding, notes = 0, {}, {}
        for msg in track:
            now += msg.time
            if msg.type == "note_on" and msg.velocity > 0:
                sounding[(msg.channel, msg.note)] = now
            elif msg.type in ("note_off", "note_on"):
                start = sounding.pop((msg.channel, msg.note), None)
                if start is not None:
                    notes.setdefault(msg.channel, []).append((start, now, msg.note))
        if notes:
            per_track.append(notes)
    if len(per_track) >= 4:
        voices = [sorted(n for ch in t.values() for n in ch) for t in per_track[:4]]
    elif len(per_track) == 1 and len(per_track[0]) >= 4:
        voices = [sorted(per_track[0][ch]) for ch in sorted(per_track[0])[:4]]
    else:
        raise SystemExit(f"{path}: four voices expected (four tracks with notes, or channels 0-3 of one track)")
    q = lambda tick: round(tick / (f.ticks_per_beat * STEP))  # noqa: E731
    quantised = []
    for v in voices:
        out = []
        for start, end, midi in v:
            on, off = q(start), max(q(end), q(start) + 1)
            if out and out[-1][0] + out[-1][1] > on:  # overlapping: the earlier note ends here
                out[-1] = (out[-1][0], on - out[-1][0], out[-1][2])
                if out[-1][1] <= 0:
                    out.pop()
            out.append((on, off - on, midi))
        quantised.append(out)
    return grid_of_notes(quantised)


# ---- the corpus

def corpus_paths():
    from music21 import corpus

    return sorted(str(p) for p in corpus.getComposer("bach") if str(p).endswith((".mxl", ".xml")))


def name_of(path):
    return os.path.basename(path).rsplit(".", 1)[0]


def load_chorale(path):
    from music21 import converter

    # No pickle written: music21 caches a parsed file for a later parse, which doubles this one's time
    # and is never read here (each chorale is parsed once a build).
    parts = voice_parts(converter.parse(path, storePickle=False))
    if parts is None:
        raise NotOnGrid("not four voice parts named soprano, alto, tenor, bass")
    return grid_of_notes([notes_of(p) for p in parts])


def cmd_split(args):
    """Every usable chorale, shuffled with a fixed seed, 80% train, 10% validation, 10% test. A
    chorale whose music appears under several BWV numbers is left to chance, as in the usual JSB
    splits."""
    names, skipped = [], {}
    for path in corpus_paths():
        try:
            load_chorale(path)
            names.append(name_of(path))
        except NotOnGrid as e:
            skipped[name_of(path)] = str(e)
    rng = random.Random(0)
    rng.shuffle(names)
    n_val = n_test = len(names) // 10
    split = {
        "test": sorted(names[:n_test]),
        "validation": sorted(names[n_test : n_test + n_val]),
        "train": sorted(names[n_test + n_val :]),
        "skipped": dict(sorted(skipped.items())),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(split, f, indent=1)
        f.write("\n")
    print(f"{len(names)} chorales: {len(split['train'])} train, {n_val} validation, {n_test} test; "
          f"{len(skipped)} skipped -> {args.out}")


def cmd_build(args):
    split = json.load(open(args.split))
    by_name = {name_of(p): p for p in corpus_paths()}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "vocab.txt"), "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=args.jobs) as pool:  # music21's parse is the time: ~0.05 s a chorale
        for part in ("train", "validation", "test"):
            missing = [n for n in split[part] if n not in by_name]
            if missing:
                raise SystemExit(f"{part}: {len(missing)} chorales of the split are not in music21's corpus: {missing[:5]}")
            grids = pool.map(load_chorale, [by_name[n] for n in split[part]], chunksize=8)
            with open(os.path.join(args.out, f"{part}.jsonl"), "w") as f:
                for name, grid in zip(split[part], grids):
                    f.write(json.dumps({"name": name, "grid": grid}) + "\n")
            print(f"{part}: {len(split[part])} chorales -> {args.out}/{part}.jsonl")


def cmd_roundtrip(args):
    import tempfile

    bad = 0
    n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for part in ("train", "validation", "test"):
            for line in open(os.path.join(args.dir, f"{part}.jsonl")):
                item = json.loads(line)
                grid = item["grid"]
                path = os.path.join(tmp, "c.mid")
                write_midi(grid, path)
                back = read_midi(path)
                tokens = tokens_of_grid(grid)
                if back != grid or grid_of_tokens(tokens) != grid:
                    bad += 1
                    print(f"{item['name']}: the round trip differs", file=sys.stderr)
                n += 1
    print(f"{n} chorales round-tripped, {bad} differing")
    return 1 if bad else 0


def cmd_prompt(args):
    by_name = {name_of(p): p for p in corpus_paths()}
    if args.chorale not in by_name:
        raise SystemExit(f"--chorale {args.chorale}: not in music21's corpus (names as in models/chorales/split.json)")
    grid = load_chorale(by_name[args.chorale])[: args.steps]
    while grid and all(t == REST for t in grid[-1]):  # a MIDI file cannot end in silence
        grid = grid[:-1]
    write_midi(grid, args.out)
    print(f"wrote {args.out}: {args.chorale}'s first {len(grid)} steps")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--out", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    b.add_argument("--split", default=os.path.join(os.path.dirname(__file__), "..", "models", "chorales", "split.json"))
    b.add_argument("--jobs", type=int, default=os.cpu_count(), help="processes parsing chorales")
    r = sub.add_parser("roundtrip")
    r.add_argument("dir")
    p = sub.add_parser("prompt")
    p.add_argument("--chorale", required=True, help="a chorale's name, e.g. bwv103.6 (a test chorale)")
    p.add_argument("--steps", type=int, default=64, help="sixteenth-note steps (64: four bars of 4/4)")
    p.add_argument("--out", required=True)
    args = ap.parse_args()
    return {"split": cmd_split, "build": cmd_build, "roundtrip": cmd_roundtrip, "prompt": cmd_prompt}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
