#!/usr/bin/python3
"""PyTorch's greedy continuation and logits on an exported model, for the parity tests: the
training module (tools/train.py) loaded from the model directory, computing in float64.

  /usr/bin/python3 tools/greedy_ref.py --model DIR --new 100 PROMPT [PROMPT ...]

Prints JSON: {"tokens": [[...], ...], "logits": [[...], ...]} where tokens are each prompt's greedy
continuation (BOS + prompt bytes in, EOS ignored) and logits are the first prompt's logits at
every position of prompt + continuation."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import BOS, LM  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--new", type=int, default=100)
    ap.add_argument("prompts", nargs="+")
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    _, model = LM.load(a.model)
    model = model.double().eval()
    out = {"tokens": [], "logits": None}
    with torch.no_grad():
        for i, p in enumerate(a.prompts):
            seq = [BOS] + list(p.encode())
            gen = []
            for _ in range(a.new):
                logits = model(torch.tensor([seq]))[0, -1]
                nxt = int(torch.argmax(logits))
                gen.append(nxt)
                seq.append(nxt)
            out["tokens"].append(gen)
            if i == 0:
                out["logits"] = model(torch.tensor([seq[:-1]]))[0].tolist()
                out["first_sequence"] = seq[:-1]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
