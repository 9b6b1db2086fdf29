"""The default ``npformer train`` against another install of npformer, in paired runs.

    python benchmarks/train_pair.py --other /path/to/venv/bin/python [--rounds 5] [--steps 100]
                                    [--out benchmarks/results/train_pair.md]

Each round runs ``python -m npformer train --steps S --log-every 1`` once with this interpreter and
once with ``--other``'s, one after the other, each in a fresh temporary working directory (so each
imports its own install, not this checkout). A run's speed is the median tokens/s of its steps
after the first five (each step logs the tokens/s of that step alone), which a burst of load on a
shared machine moves less than the run's total time; the rounds alternate the two so that a slow
hour slows both. The report gives every run, the two medians, their ratio, and each run's last
loss (the same data and seeds: equal losses say both trained the same model). Host-only: no
PyTorch, nothing timed in a test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP_STEPS = 5


def run_once(python: str, steps: int) -> dict:
    """One ``npformer train`` in a fresh directory: its median per-step tokens/s and last loss."""
    with tempfile.TemporaryDirectory(prefix="npformer-train-pair-") as tmp:
        cmd = [python, "-m", "npformer", "train", "--steps", str(steps), "--log-every", "1", "--out-dir", "run"]
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    speeds = [r["tokens_per_s"] for r in train[WARMUP_STEPS:]]
    return {"tokens_per_s": statistics.median(speeds), "time_s": train[-1]["time_s"], "loss": train[-1]["loss"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--other", required=True, help="the Python interpreter of the other npformer install")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default=None, help="also write the report here (markdown)")
    a = p.parse_args(argv)
    if a.steps <= WARMUP_STEPS or a.rounds < 1:
        p.error(f"--steps must exceed {WARMUP_STEPS} and --rounds be at least 1")
    pythons = {"this": sys.executable, "other": a.other}
    runs: dict[str, list[dict]] = {name: [] for name in pythons}
    lines = ["| round | this: tok/s | other: tok/s | this / other | this: loss | other: loss |", "|---|---|---|---|---|---|"]
    for k in range(1, a.rounds + 1):
        for name, python in pythons.items():
            runs[name].append(run_once(python, a.steps))
        this, other = runs["this"][-1], runs["other"][-1]
        lines.append(f"| {k} | {this['tokens_per_s']:,.0f} | {other['tokens_per_s']:,.0f} | "
                     f"{this['tokens_per_s'] / other['tokens_per_s']:.2f}x | {this['loss']:.6f} | {other['loss']:.6f} |")
        print(lines[-1], flush=True)
    med = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    report = "\n".join([
        f"`npformer train --steps {a.steps}`, {a.rounds} paired rounds; per run the median tokens/s of steps "
        f"{WARMUP_STEPS + 1}-{a.steps}.", "", f"- this: `{sys.executable}`", f"- other: `{a.other}`", "", *lines, "",
        f"Medians: this {med['this']:,.0f} tok/s, other {med['other']:,.0f} tok/s: this at "
        f"{med['this'] / med['other']:.2f}x the other's speed."])
    print(report.splitlines()[-1])
    if a.out:
        Path(a.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
