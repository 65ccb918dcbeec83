"""Example: python3 examples/generate.py [--server HOST:PORT] [prompt...]"""
import argparse

from relgen_client import Client, RelgenError


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", default="localhost:50051")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("prompt", nargs="*", default=["Once upon a time"])
    a = ap.parse_args()
    prompt = " ".join(a.prompt)
    with Client(a.server, timeout=60) as client:
        print("model:", client.info()["name"])
        done = client.generate(prompt, max_new_tokens=a.max_new_tokens, temperature=0)
        print(f"generate: {done.text!r} ({done.finish_reason}, {done.generated_tokens} tokens)")
        print("stream:   ", end="")
        for chunk in client.stream(prompt, max_new_tokens=a.max_new_tokens, temperature=0):
            print(chunk.text, end="", flush=True)
            if chunk.finish_reason:
                print(f"  [{chunk.finish_reason}]")
        try:
            client.generate(prompt, temperature=-1)
        except RelgenError as e:
            print("error:", e.code, "-", e.details)


if __name__ == "__main__":
    main()
