#!/usr/bin/env python3
"""Counts compute-sanitizer findings in ZeroTrain's own kernels apart from the libraries' kernels.

racecheck reports hazards inside cuDNN's Hopper SDPA kernels (wgmma/TMA barriers it cannot model);
counted together with ours they bury our result. This reads one compute-sanitizer log (memcheck,
racecheck, initcheck or synccheck), splits its reports by the kernel they name, and prints one
line: findings in ZeroTrain's kernels (our namespace zt::, and the CUB/Thrust/libcu++ templates our
code instantiates; or, where the report names a source file, one of our tree or of CCCL's headers),
findings in library kernels (cuDNN, cuBLAS, NCCL: every other name, with the most frequent listed),
API errors (a CUDA call that failed, or a host API call such as cudaMemcpy that read bytes nothing
wrote or touched memory out of bounds: ZeroTrain makes those calls, so ours to fix too), and the
tool's own summary.
Standard library only. Usage: sanitizer_summary.py LOG [--tool NAME]
Exit status: 0 when no finding is ZeroTrain's and no API error was reported, 1 otherwise, 2 when
the log is unreadable or holds no compute-sanitizer summary (the run was cut short).
"""
import argparse
import re
import sys

OURS = re.compile(r"\bzt::|\bcub::|\bthrust::|\bcuda::std::|\bzt_")
# A source file a report names (builds with -lineinfo): our kernels' folders, or CCCL's headers
# (CUB, Thrust, libcu++: templates compiled into our kernels). Library kernels carry no line info.
OUR_FILE = re.compile(r"(?:^|[\s/])(?:kernels|src|optimizers|memory)/\S*\.(?:cu|cuh|h):\d+"
                      r"|/(?:cub|thrust|cuda/std|cccl)/\S*:\d+")
# Host API accesses: initcheck's "Uninitialized access at 0x... on access by cudaMemcpy source",
# memcheck's "Host API memory access error at host access to 0x...": a call ZeroTrain made.
HOST_API = re.compile(r"\bHost API\b|\bon access by cuda\w*", re.IGNORECASE)
# A report's first line: "========= <what>" at the left margin (continuation lines are indented).
HEADER = re.compile(r"^========= (?! )(?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER|LEAK SUMMARY|Target application)"
                    r"(?!Saved host backtrace|Host Frame|Device Frame)(\S.*)$")
# "at KERNEL+0x70 in FILE:LINE" (CUDA 12/13), "at 0x70 in FILE:LINE:KERNEL" (older), and racecheck's
# "Race reported between Write access at KERNEL+0x10 in FILE and Read access at ...".
KERNEL = re.compile(r"\bat (?:0x[0-9a-f]+ in )?(?:\S+:\d+:)?(.+?)(?:\+0x[0-9a-f]+| in |$)")
SUMMARY = re.compile(r"(ERROR SUMMARY: .*|RACECHECK SUMMARY: .*|LEAK SUMMARY: .*)")


def kernel_of(lines):
    """The kernel a report names: the first "at ..." in its header or the lines under it."""
    for line in lines:
        body = line.lstrip("= ").strip()
        if body.startswith(("Host Frame", "Saved host backtrace")):
            break
        i = body.find(" at ") if not body.startswith("at ") else 0
        if i < 0:
            continue
        m = KERNEL.match(body[i:].strip())
        if m:
            return m.group(1).strip()
    return None


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--tool", default="", help="a name for the line (default: the log's file name)")
    args = ap.parse_args(argv)
    try:
        with open(args.log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        print(f"sanitizer_summary: cannot read {args.log}: {e}", file=sys.stderr)
        return 2
    reports = []  # [header, following lines...]
    summaries = []
    for line in lines:
        s = SUMMARY.search(line)
        if s:
            summaries.append(s.group(1))
            continue
        if HEADER.match(line):
            reports.append([line])
        elif reports and line.startswith("=========") and line.strip("= "):
            reports[-1].append(line)
    ours, library, api = [], {}, []
    for r in reports:
        head = r[0].lstrip("= ").strip()
        if head.startswith("Program hit"):
            api.append(head)
            continue
        body = [line.lstrip("= ").strip() for line in r]
        before_host = body[:next((i for i, b in enumerate(body) if b.startswith(("Host Frame", "Saved host"))),
                                 len(body))]
        if any(HOST_API.search(b) for b in before_host):
            api.append(" / ".join(before_host)[:200])
            continue
        name = kernel_of(r)
        if name is None:
            continue  # a line of the tool's that is no finding (e.g. "Internal Sanitizer Error" context)
        if OURS.search(name) or any(OUR_FILE.search(b) for b in before_host):
            ours.append(f"{head[:80]} in {name[:120]}")
        else:
            short = re.sub(r"[<(].*", "", name)[:90]
            library[short] = library.get(short, 0) + 1
    tool = args.tool or args.log.rsplit("/", 1)[-1]
    lib_total = sum(library.values())
    top = ", ".join(f"{n} x{c}" for n, c in sorted(library.items(), key=lambda kv: -kv[1])[:3])
    print(f"{tool}: {len(ours)} finding(s) in ZeroTrain's kernels, {lib_total} in library kernels"
          f"{' (' + top + ')' if top else ''}, {len(api)} API error(s); "
          f"{'; '.join(summaries) if summaries else 'no summary line (cut short?)'}")
    for o in ours[:10]:
        print(f"  ours: {o}")
    for a in api[:5]:
        print(f"  api: {a[:200]}")
    if not summaries:
        return 2
    return 1 if ours or api else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
