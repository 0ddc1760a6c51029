#!/usr/bin/env python3
"""GPU-vs-CPU check of `zerotrain generate` (scripts/gpu-check.sh): two greedy fp32 runs of one
checkpoint and prompt, each with --log-format json and --dump-step-logits, compared within the
tolerance policy's derived bound (tests/README.md).

usage: compare_generate.py CHECKPOINT_DIR A.json A.f32 B.json B.f32   (A: the GPU run, B: the CPU run)

Checks: each run drew every token as the first argmax of the row it dumped (the sampler is host
code on both backends; ids < vocab, padding never drawn); while the two sequences agree, every step's
logits agree within the bound. Bound, per row, relative to its largest |logit|: test_generate's
first-order model (10 rounding points per layer plus 3, layernorm doubling at most) with a vendor's
per-point error gamma_{4C}(2^-23) + 2 * 2^-24 (tests/tolerance.h: fp32 accumulation over the
longest reduction, 4C, plus r = 2 roundings), each run within it of float64, so the two within twice:
4 (10 L + 3) (gamma_{4C}(2^-23) + 2^-23). The first step where the tokens differ is compared too
(its prefix is common): there the bound implies a near-tie, so the sequences may part there (noted)
and later steps, whose prefixes differ, are not compared. Exit 0 when the check holds, 1 when not,
2 on unreadable input.
"""
import array
import json
import os
import sys


def fail_input(msg):
    print(f"compare_generate: {msg}", file=sys.stderr)
    sys.exit(2)


def run_of(json_path, logits_path, vocab):
    tokens = None
    try:
        for line in open(json_path, encoding="utf-8", errors="replace"):
            if line.startswith("{") and '"tokens"' in line:
                tokens = json.loads(line)["tokens"]
    except OSError as e:
        fail_input(f"{json_path}: {e.strerror}")
    if tokens is None:
        fail_input(f"{json_path}: no generate JSON line (--log-format json)")
    logits = array.array("f")
    try:
        with open(logits_path, "rb") as f:
            logits.frombytes(f.read())
    except OSError as e:
        fail_input(f"{logits_path}: {e.strerror}")
    if sys.byteorder != "little":
        logits.byteswap()
    if len(logits) != len(tokens) * vocab:
        fail_input(f"{logits_path}: {len(logits)} floats, not {len(tokens)} tokens x vocab {vocab}")
    return tokens, [logits[i * vocab:(i + 1) * vocab] for i in range(len(tokens))]


def first_argmax(row):
    best = 0
    for i, x in enumerate(row):
        if x > row[best]:
            best = i
    return best


def main(argv):
    if len(argv) != 6:
        fail_input("usage: compare_generate.py CHECKPOINT_DIR A.json A.f32 B.json B.f32")
    try:
        model = json.load(open(os.path.join(argv[1], "manifest.json")))["meta"]["model"]
        L, C, V = int(model["layers"]), int(model["embd"]), int(model["vocab"])
    except (OSError, KeyError, ValueError) as e:
        fail_input(f"{argv[1]}: no GPT model in its manifest ({e})")
    a_tok, a_rows = run_of(argv[2], argv[3], V)
    b_tok, b_rows = run_of(argv[4], argv[5], V)
    bad = []
    if len(a_tok) != len(b_tok):
        bad.append(f"{len(a_tok)} tokens against {len(b_tok)}")
    for name, tok, rows in (("A", a_tok, a_rows), ("B", b_tok, b_rows)):
        for i, (t, row) in enumerate(zip(tok, rows)):
            if not 0 <= t < V or t != first_argmax(row):
                bad.append(f"run {name} token {i} is {t}, not the argmax {first_argmax(row)} of its logits")
                break
    n = min(len(a_tok), len(b_tok))
    k = next((i for i in range(n) if a_tok[i] != b_tok[i]), n)  # the first step whose tokens differ
    u_acc, K = 2.0 ** -23, 4 * C
    gamma = K * u_acc / (1 - K * u_acc)
    rel = 4 * (10 * L + 3) * (gamma + 2 * 2.0 ** -24)
    worst, worst_step = 0.0, 0
    for i in range(min(k + 1, n)):
        mx = max(abs(x) for x in b_rows[i])
        err = max(abs(x - y) for x, y in zip(a_rows[i], b_rows[i]))
        if not err <= rel * mx:  # NaN fails
            bad.append(f"step {i}: max |difference| {err:.3e} above the bound {rel * mx:.3e} ({rel:.2e} of max |logit| {mx:.4g})")
        ratio = err / (rel * mx) if mx > 0 else float("inf")
        if ratio > worst:
            worst, worst_step = ratio, i
    agree = "identical tokens" if k == n else f"tokens part at step {k} (a near-tie the bound allows; later steps not compared)"
    print(f"generate A vs B: {n} greedy tokens, {agree}; {min(k + 1, n)} steps' logits, worst err/bound {worst:.2e} "
          f"(step {worst_step}; bound {rel:.2e} x max |logit|, L={L} C={C} V={V})")
    for b in bad:
        print(f"FAIL: {b}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
