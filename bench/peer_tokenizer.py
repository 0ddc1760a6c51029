#!/usr/bin/env python3
"""Peer test: `zerotrain tokenize` against Hugging Face `tokenizers` (ByteLevel BPE, GPT-2's scheme)
on >= 1 MB of mixed text (Python sources, prose with contractions, digits, whitespace runs, accented
and non-Latin scripts, emoji, non-breaking and ideographic spaces). Both directions:
  1. zerotrain learns N merges (--train-merges); tokenizers loads its vocab.json + merges.txt;
  2. tokenizers learns a ByteLevel BPE; zerotrain loads it (--vocab/--merges).
Each time the shards' tokens must equal tokenizers' ids for every input file, exactly.

Installs `tokenizers` from PyPI into a venv (default ~/.cache/zerotrain-peer-venv) when run; CI never
runs it. Usage:
    python3 bench/peer_tokenizer.py [--zerotrain build/release/apps/zerotrain] [--merges 5000]
Exit code 0 when every comparison matches.
"""
import argparse
import glob
import os
import random
import struct
import subprocess
import sys
import tempfile
import venv


def ensure_tokenizers(venv_dir):
    try:
        import tokenizers  # noqa: F401
        return
    except ImportError:
        pass
    py = os.path.join(venv_dir, "bin", "python3")
    if not os.path.exists(py):
        venv.create(venv_dir, with_pip=True)
        subprocess.check_call([py, "-m", "pip", "install", "-q", "tokenizers"])
    os.execv(py, [py] + sys.argv)  # rerun inside the venv


def mixed_text(seed, min_bytes):
    rng = random.Random(seed)
    parts = []
    srcs = sorted(glob.glob("/usr/lib/python3*/*.py"))
    size = 0
    for path in srcs:
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
        size += len(parts[-1])
        if size > min_bytes // 2:
            break
    words = ["the", "The", "quick", "brown", "fox", "don't", "I'm", "we'll", "they're", "it's", "I've", "he'd",
             "DON'T", "'s", "1984", "3.14159", "1,000,000", "naïve", "café", "Straße", "東京タワー", "Привет",
             "мир", "مرحبا", "שלום", "नमस्ते", "😀", "👍🏽", "🎉!", "e\u0301", "½", "Ⅷ", "²", "(!?)", "--", "...",
             "\u00a0", "\u3000", "\u2003", "\t", "\n", "\n\n", "   ", "\r\n", "x''s", "ok'", "'quoted'"]
    prose, size = [], 0
    while size < min_bytes // 2:
        prose.append(rng.choice(words))
        prose.append(rng.choice([" ", " ", " ", "", "  ", "\n", ", ", ". "]))
        size += len(prose[-2]) + len(prose[-1])
    parts.append("".join(prose))
    return parts


def read_shards(pattern):
    out = []
    for path in sorted(glob.glob(pattern)):
        with open(path, "rb") as f:
            header = struct.unpack("<256i", f.read(1024))
            assert header[0] == 20240520 and header[1] == 1, path
            n = header[2]
            out.extend(struct.unpack("<%dH" % n, f.read(2 * n)))
    return out


def zerotrain_ids(zt, files, out, extra):
    subprocess.check_call([zt, "tokenize", *files, "--out", out, "--val-fraction", "0", *extra],
                          stdout=subprocess.DEVNULL)
    return read_shards(os.path.join(out, "train_*.bin")) + read_shards(os.path.join(out, "val_*.bin"))


def compare(name, ours, theirs):
    if ours == theirs:
        print(f"{name}: {len(ours)} tokens, identical")
        return True
    i = next((k for k in range(min(len(ours), len(theirs))) if ours[k] != theirs[k]), min(len(ours), len(theirs)))
    print(f"{name}: MISMATCH at token {i} of {len(ours)} (zerotrain) / {len(theirs)} (tokenizers): "
          f"{ours[max(0, i - 5):i + 5]} vs {theirs[max(0, i - 5):i + 5]}")
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--zerotrain", default="build/release/apps/zerotrain")
    ap.add_argument("--merges", type=int, default=5000)
    ap.add_argument("--min-bytes", type=int, default=1_200_000)
    ap.add_argument("--venv", default=os.path.expanduser("~/.cache/zerotrain-peer-venv"))
    args = ap.parse_args()
    ensure_tokenizers(args.venv)
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    zt = os.path.abspath(args.zerotrain)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        texts = mixed_text(1, args.min_bytes)
        files = []
        for i, t in enumerate(texts):
            files.append(os.path.join(tmp, "doc%03d.txt" % i))
            with open(files[-1], "w", encoding="utf-8") as f:
                f.write(t)
        total = sum(len(t.encode()) for t in texts)
        print(f"corpus: {len(files)} files, {total} bytes")

        def hf_ids(tok, eot):
            ids = []
            for t in texts:
                ids.append(eot)
                ids.extend(tok.encode(t).ids)
            return ids

        def hf_from_files(vocab, merges):
            tok = Tokenizer(models.BPE.from_file(vocab, merges))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            return tok

        # 1. zerotrain learns the merges, tokenizers loads them.
        out1 = os.path.join(tmp, "tok1")
        ours = zerotrain_ids(zt, files, out1, ["--train-merges", str(args.merges)])
        tok = hf_from_files(os.path.join(out1, "vocab.json"), os.path.join(out1, "merges.txt"))
        eot = tok.token_to_id("<|endoftext|>")
        ok &= compare(f"zerotrain-trained merges ({args.merges}), encoded by both", ours, hf_ids(tok, eot))
        ok &= tok.decode(ours[1:1 + 2000]) != ""

        # 2. tokenizers learns the merges, zerotrain loads them.
        hf = Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=256 + args.merges, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        hf.train(files, trainer)
        d2 = os.path.join(tmp, "hf")
        os.makedirs(d2)
        hf.model.save(d2)
        tok2 = hf_from_files(os.path.join(d2, "vocab.json"), os.path.join(d2, "merges.txt"))
        ours2 = zerotrain_ids(zt, files, os.path.join(tmp, "tok2"),
                              ["--vocab", os.path.join(d2, "vocab.json"), "--merges", os.path.join(d2, "merges.txt")])
        ok &= compare("tokenizers-trained merges, encoded by both", ours2, hf_ids(tok2, tok2.token_to_id("<|endoftext|>")))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
