#!/usr/bin/env python3
"""Peer test: `zerotrain export --format hf` loads in Hugging Face transformers and gives ZeroTrain's
logits. A small run end to end (tokenize a generated text with learned merges, train a tiny GPT on
2 simulated devices, export), then GPT2LMHeadModel.from_pretrained(DIR) in fp32 against
`zerotrain generate --dump-logits` on a batch of prompts: max |difference| <= 1e-4 x max |logit|.
The exported GPT2Tokenizer must also encode the prompts to ZeroTrain's ids.

Needs Debian's python3-torch (scripts/setup --peer); installs `transformers` from PyPI into a venv
(default ~/.cache/zerotrain-peer-hf-venv, with the system's site packages for torch) when run; CI
never runs it. Usage (with the system Python that python3-torch installs into):
    /usr/bin/python3 bench/peer_hf_export.py [--zerotrain build/release/apps/zerotrain]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import venv


def ensure_transformers(venv_dir):
    try:
        import transformers  # noqa: F401
        import torch  # noqa: F401
        return
    except ImportError:
        pass
    py = os.path.join(venv_dir, "bin", "python3")
    if not os.path.exists(py):
        venv.create(venv_dir, with_pip=True, system_site_packages=True)
        # transformers releases that still accept Debian 12's torch 1.13
        subprocess.check_call([py, "-m", "pip", "install", "-q", "transformers>=4.38,<4.45"])
    os.execv(py, [py] + sys.argv)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zerotrain", default="build/release/apps/zerotrain")
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/zerotrain-peer-hf-venv"))
    args = ap.parse_args()
    ensure_transformers(args.venv)
    import numpy as np
    import torch
    from transformers import GPT2LMHeadModel, GPT2Tokenizer

    zt = os.path.abspath(args.zerotrain)
    rng = random.Random(3)
    words = ["The", "the", "cat", "sat", "on", "a", "mat", "it's", "don't", "1984", "naïve", "東京", "dog", ",", "."]
    text = " ".join(rng.choice(words) for _ in range(20000))
    prompts = ["The cat sat on", "It's 1984, naïve dog", "東京 the mat.", "don't"]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        def z(*a):
            subprocess.check_call([zt, *a], cwd=tmp, stdout=subprocess.DEVNULL)
        with open(os.path.join(tmp, "book.txt"), "w", encoding="utf-8") as f:
            f.write(text)
        z("tokenize", "book.txt", "--train-merges", "300", "--out", "tok")
        z("train", "--data", "tok/*.bin", "--checkpoint-dir", "ck", "--devices", "cpu:2", "--steps", "20",
          "--zero-stage", "3", "--sample-tokens", "0", "--quiet")
        z("export", "--checkpoint", "ck", "--format", "hf", "--out", "hf")
        model = GPT2LMHeadModel.from_pretrained(os.path.join(tmp, "hf"), torch_dtype=torch.float32).eval()
        tok = GPT2Tokenizer.from_pretrained(os.path.join(tmp, "hf"))
        V = model.config.vocab_size
        for i, p in enumerate(prompts):
            out = subprocess.check_output([zt, "generate", "--checkpoint", "ck", "--prompt", p, "--max-new-tokens", "0",
                                           "--log-format", "json", "--precision", "fp32", "--dump-logits", f"l{i}.bin"],
                                          cwd=tmp)
            ids = json.loads(out)["prompt_tokens"]
            ours = np.fromfile(os.path.join(tmp, f"l{i}.bin"), dtype=np.float32).reshape(len(ids), V)
            with torch.no_grad():
                theirs = model(torch.tensor([ids])).logits[0].numpy()
            rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
            same_ids = tok.encode(p) == ids
            print(f"prompt {p!r}: {len(ids)} tokens, max |diff| / max |logit| = {rel:.2e}, "
                  f"GPT2Tokenizer ids {'equal' if same_ids else 'DIFFER: ' + str(tok.encode(p)) + ' vs ' + str(ids)}")
            ok &= rel <= 1e-4 and same_ids
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
