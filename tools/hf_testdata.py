"""What tools/make_hf_checkpoints.py and tools/make_t5_checkpoints.py share: the local corpus and
broken copies of good checkpoints, each with the words relgen must use when it refuses it."""
import glob
import json
import os
import shutil
import sys


def fortunes():
    """Debian's fortunes (package fortunes), one string per fortune."""
    text = []
    for p in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if p.endswith((".dat", ".u8")) or os.path.isdir(p):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            text.append(f.read())
    if not text:
        sys.exit("no fortunes under /usr/share/games/fortunes (apt-get install fortunes)")
    return "\n".join(text).split("\n%\n")


class BrokenCopies:
    """Copies of a good checkpoint under OUT/bad/ that relgen must refuse; manifest["bad"] lists each
    with the substrings its refusal must contain."""

    def __init__(self, out, good, manifest):
        self.root = os.path.join(out, "bad")
        self.good = good
        self.manifest = manifest
        os.makedirs(self.root, exist_ok=True)

    def copy(self, name, src=None):
        d = os.path.join(self.root, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src or self.good, d)
        return d

    @staticmethod
    def edit_config(d, fn, name="config.json"):
        """fn(the JSON file `name` in d, parsed), written back."""
        p = os.path.join(d, name)
        with open(p) as f:
            c = json.load(f)
        fn(c)
        with open(p, "w") as f:
            json.dump(c, f, indent=2)

    def expect(self, name, d, *substrings):
        self.manifest["bad"].append({"name": name, "dir": d, "expect": list(substrings)})

    def missing_shard(self, name):
        d = self.copy(name, self.good + "-sharded")
        shards = sorted(glob.glob(os.path.join(d, "model-*.safetensors")))
        os.remove(shards[-1])
        self.expect(name, d, os.path.basename(shards[-1]), "not in")

    def unknown_key(self, name):
        d = self.copy(name)
        self.edit_config(d, lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}))
        self.expect(name, d, "rope_scaling", "not known to relgen")
