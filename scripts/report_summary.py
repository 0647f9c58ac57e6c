#!/usr/bin/env python
"""The performance issue's targets, read off one `scripts/perf_report.sh` folder: a
markdown table of each target, what the report measured, and whether it is met there.

  python scripts/report_summary.py runs/perfN/report

What this is: a reader of the files perf_report.sh writes (bench_peers tables, `cubedqn
profile` JSON and text, the one-minute training runs, bench_startup and bench_replay
output), so that README's table comes from the run and not from copying numbers by hand.
What it is not: a benchmark; it times nothing. A file the report lacks (a run cut short,
an older report) leaves its rows out and is named on stderr.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

# the peer targets: (shape line prefix, peer, ratio needed)
PEER_TARGETS = (("144-256-256-12", "jax jit", 2.0), ("144-256-256-12", "pytorch eager", 4.0),
                ("324-1024-512-12", "jax jit", 1.5), ("324-1024-512-12", "pytorch eager", 3.0))
E2E_SHARE, GEMM_SHARE = 0.70, 0.70            # end to end / train step; GEMM layers / sgemm peak
WARM_S, COLD_S = 3.0, 30.0                    # start-up: training begins within
ADD_MPS, SAMPLE_KPS = 20.0, 100.0             # replay: add of 64 (M transitions/s), sample (k batches/s)
BYTES_CUBE2 = 64                              # replay: bytes a 2x2x2 transition
# what the table reads from a `cubedqn profile --json` file
PROFILE_KEYS = ("gemm_layers_gflops", "peak_gflops", "train_step_ms", "steps_per_min")


def peer_tables(text: str) -> dict[str, dict[str, tuple[float, float]]]:
    """bench_peers output -> {network: {implementation: (ms per step, its time over
    cubedqn's as the table prints it)}}, one entry per table (the network is the first word
    of the line above the table's header)."""
    tables, network, rows = {}, None, None
    for line in text.splitlines():
        words = line.split()
        if words and re.fullmatch(r"\d+(-\d+)+", words[0]):
            network, rows = words[0], None
        elif line.startswith("implementation") and network:
            rows = tables.setdefault(network, {})
        elif rows is not None:
            m = re.match(r"(\S.*?)\s{2,}(\d+\.\d+)\s+\d+\s+[\d.]+\s+(\d+\.\d+)x$", line)
            if m:
                rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
            else:
                rows = None
    return tables


def preset_rates(text: str) -> tuple[float, float] | None:
    """`cubedqn profile` text -> (end-to-end gradient steps/min, train-step steps/min)."""
    e2e = re.search(r"^end to end: (\d+) gradient steps/min", text, re.M)
    step = re.search(r"^train step .*= (\d+) steps/min", text, re.M)
    return (float(e2e.group(1)), float(step.group(1))) if e2e and step else None


def trained_steps(text: str) -> int | None:
    """`cubedqn train` output -> gradient steps of its "trained N gradient steps" line."""
    m = re.search(r"^trained (\d+) gradient steps", text, re.M)
    return int(m.group(1)) if m else None


def trained_run(text: str) -> tuple[int, int | None] | None:
    """`cubedqn train` output -> (its gradient steps, the GEMM threads its tuner kept at the
    end: its "thread tuning: the GEMMs on K of N thread(s)" line, None without one); None
    without a steps line."""
    steps = trained_steps(text)
    if steps is None:
        return None
    m = re.search(r"^thread tuning: the GEMMs on (\d+) of \d+ thread", text, re.M)
    return steps, int(m.group(1)) if m else None


def startup_medians(text: str) -> dict[str, float]:
    """bench_startup output -> {"cold", "warm", "cold, CUBEDQN_COMPILE_AHEAD=0"}: the median
    second at which training began."""
    out = {}
    for m in re.finditer(r"^(cold cache|warm cache)(, CUBEDQN_COMPILE_AHEAD=0)?: .*?training began "
                         r"\(\"kernels ready\"\) at median ([\d.]+) s", text, re.M):
        out[m.group(1).split()[0] + (m.group(2) or "")] = float(m.group(3))
    return out


def replay_rates(text: str) -> dict[str, float]:
    """bench_replay output -> {"cube2 uniform add 64": M/s, "cube2 uniform sample": k/s, ...}."""
    out = {}
    for m in re.finditer(r"^(cube\d) (uniform|prioritized)\s+add\s+batches of\s+64:\s+([\d.]+) M", text, re.M):
        out[f"{m.group(1)} {m.group(2)} add 64"] = float(m.group(3))
    for m in re.finditer(r"^(cube\d) (uniform|prioritized)\s+sample batches of 64:\s+([\d.]+) k", text, re.M):
        out[f"{m.group(1)} {m.group(2)} sample"] = float(m.group(3))
    return out


def _yes(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _or_none(parse, text):
    return parse(text) if text is not None else None


def threads_row(what: str, pairs: list[tuple[float, float]], unit: str, kept=None) -> tuple[str, str, str]:
    """The --threads 2 row of one command from its (one thread, two threads) rates, one pair
    a round: the median of the pairs' ratios decides (perf_report.sh times each pair back to
    back; a single pair reads a slow window of the host's second CPU as the code's). kept:
    the threads each two-thread run kept, noted where all are known."""
    note = f"kept {', '.join(str(k) for k in kept)} thread(s)" if kept and None not in kept else ""
    ratios = [two / one for one, two in pairs]
    med = statistics.median(ratios)
    target = f"--threads 2 not slower than 1 end to end ({what})"
    if len(pairs) == 1:
        (one, two), = pairs
        return target, f"{med:.2f}x ({one:,.0f} -> {two:,.0f} {unit}{', ' + note if note else ''})", _yes(med >= 1.0)
    listed = ", ".join(f"{r:.2f}x" for r in ratios)
    return (target, f"{med:.2f}x (median of {len(pairs)} alternating pairs: {listed}{'; ' + note if note else ''})",
            _yes(med >= 1.0))


class Report:
    def __init__(self, folder: Path):
        self.folder, self.missing = folder, []

    def text(self, name):
        path = self.folder / name
        if not path.is_file():
            self.missing.append(name)
            return None
        return path.read_text()

    def pairs(self, stem, ext, read):
        """[(one thread, two threads)] of perf_report.sh's rounds of STEM at --threads 1 and 2,
        read(name) each: round 1's files STEM-t1.EXT and STEM-t2.EXT, round r's
        STEM-t1-rR.EXT and STEM-t2-rR.EXT, up to the first round the folder lacks (an older
        report has round 1 only); [] where round 1 is not there (or does not read)."""
        out, r = [], 1
        while True:
            sfx = "" if r == 1 else f"-r{r}"
            names = [f"{stem}-t{t}{sfx}.{ext}" for t in (1, 2)]
            if r > 1 and not all((self.folder / n).is_file() for n in names):
                return out
            one, two = (read(n) for n in names)
            if one is None or two is None:
                return out
            out.append((one, two))
            r += 1

    def json(self, name):
        text = self.text(name)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{self.folder / name} is not a JSON profile ({e})") from None
        missing = [k for k in PROFILE_KEYS if k not in data]
        if missing:
            raise ValueError(f"{self.folder / name} lacks {', '.join(missing)} (not `cubedqn profile --json`?)")
        return data


def summary_rows(report: Report) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for each of the issue's targets the report has numbers for."""
    rows = []
    for name, label in (("peers.txt", "momentum"), ("peers-adam.txt", "Adam")):
        text = report.text(name)
        if text is None:
            continue
        tables = peer_tables(text)
        for network, peer, need in PEER_TARGETS:
            t = tables.get(network, {})
            if "cubedqn" in t and peer in t:
                (ms, ratio), ours = t[peer], t["cubedqn"][0]
                rows.append((f"{network}: >= {need:g}x {peer} ({label}, bench_peers)",
                             f"{ratio:.2f}x ({ms:.3f} / {ours:.3f} ms)", _yes(ratio >= need)))
    for name, what in (("profile-cube2-double-t1.json", "the issue's cube2 command"),
                       ("profile-cube2-double-stickers-momentum-t1.json", "its momentum twin"),
                       ("profile-cube3-double-t1.json", "the issue's cube3 command")):
        d = report.json(name)
        if d is None:
            continue
        share = d["gemm_layers_gflops"] / d["peak_gflops"]
        done = d.get("gemm_layers_done_fraction")  # tile_sparse.py left out zero terms: the FMAs done
        done_note = (f"; dense-equivalent: they did {done:.0%} of the multiply-adds, {share * done:.0%} of the peak "
                     f"for those" if done is not None and done < 1 else "")
        rows.append((f"GEMM layers >= {GEMM_SHARE:.0%} of the sgemm peak ({what}, 1 thread)",
                     f"{share:.0%} ({d['gemm_layers_gflops']:.1f} of {d['peak_gflops']:.1f} GFLOP/s{done_note}); "
                     f"train step {d['train_step_ms']:.3f} ms", _yes(share >= GEMM_SHARE)))
    for name, what in (("profile-cube2-preset-t1.txt", "`cube2` preset"),
                       ("profile-cube2-preset-eps05-t1.txt", "`cube2` preset at --epsilon 0.05")):
        text = report.text(name)
        rates = preset_rates(text) if text is not None else None
        if rates:
            e2e, step = rates
            rows.append((f"end to end >= {E2E_SHARE:.0%} of the train-step rate ({what}, 1 thread)",
                         f"{e2e / step:.0%} ({e2e:,.0f} of {step:,.0f} steps/min)", _yes(e2e >= E2E_SHARE * step)))
    for stem, what in (("profile-cube2-double", "the issue's cube2 command"),
                       ("profile-cube2-double-stickers-momentum", "its momentum twin"),
                       ("profile-cube3-double", "the issue's cube3 command")):
        pairs = report.pairs(stem, "json", report.json)
        if pairs:
            rows.append(threads_row(what, [(one["steps_per_min"], two["steps_per_min"]) for one, two in pairs],
                                    "steps/min", [two.get("blas_threads") for _, two in pairs]))
    pairs = report.pairs("profile-cube2-preset", "txt", lambda name: _or_none(preset_rates, report.text(name)))
    if pairs:
        rows.append(threads_row("`cube2` preset, profile", [(one[0], two[0]) for one, two in pairs], "steps/min"))
    pairs = report.pairs("train-cube2", "txt", lambda name: _or_none(trained_run, report.text(name)))
    if pairs:
        rows.append(threads_row("`train --profile cube2 --minutes 1`", [(one[0], two[0]) for one, two in pairs],
                                "gradient steps in the minute", [two[1] for _, two in pairs]))
    text = report.text("startup.txt")
    if text is not None:
        s = startup_medians(text)
        if "warm" in s:
            rows.append((f"start-up, warm cache: training begins within {WARM_S:g} s (cube2-quick)",
                         f"{s['warm']:.2f} s (median)", _yes(s["warm"] <= WARM_S)))
        if "cold" in s:
            alone = s.get("cold, CUBEDQN_COMPILE_AHEAD=0")
            rows.append((f"start-up, cold cache: within {COLD_S:g} s (cube2-quick)",
                         f"{s['cold']:.2f} s (median; one compiling process: {alone:.2f} s)" if alone
                         else f"{s['cold']:.2f} s (median)", _yes(s["cold"] <= COLD_S)))
    text = report.text("replay.txt")
    if text is not None:
        r = replay_rates(text)
        for key in sorted(r):
            add = " add " in key
            need, unit = (ADD_MPS, "M transitions/s") if add else (SAMPLE_KPS, "k batches/s")
            rows.append((f"replay {key.replace(' 64', '')} of 64 >= {need:g} {unit}", f"{r[key]:.1f} {unit}",
                         _yes(r[key] >= need)))
        m = re.search(r"^cube2 memory: (\d+) bytes per transition", text, re.M)
        if m:
            rows.append((f"replay: <= {BYTES_CUBE2} B a 2x2x2 transition", f"{m.group(1)} B", _yes(int(m.group(1)) <= BYTES_CUBE2)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a perf_report.sh output folder (its OUT)")
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        ap.error(f"no such folder: {args.folder}")
    report = Report(args.folder)
    try:
        rows = summary_rows(report)
    except ValueError as e:
        print(f"report_summary.py: {e}", file=sys.stderr)
        return 2
    print("| target | measured | |")
    print("| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if report.missing:
        print(f"not in {args.folder}: {', '.join(sorted(set(report.missing)))}", file=sys.stderr)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
