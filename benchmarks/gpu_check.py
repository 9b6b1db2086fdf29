"""The one-command check of a GPU machine, sized to a time budget (``benchmarks/gpu_check.sh`` runs it)::

    bash benchmarks/gpu_check.sh OUT_DIR [--budget SECONDS] [--only STAGE,...]

Stages run in priority order, each writing its results as soon as it ends; a stage that no longer
fits the budget is skipped, and says so. With a budget (480 s fits one 10-minute call of a GPU lease,
with the machine's start and the transfers around it) each stage's timeout is what is left of it.
Without one every stage runs to its own cap. What the GPU work asks first comes first: on the first
H200 (2026-11-28) device, primitives, kernel tests, steps and sweep took about 300 s together (the
steps stage has since gained torch.compile and CUDA-graph cases, so 480 s may no longer reach the
sweep and ncu stages). ``--only`` runs the stages named (the device facts always first): a second
call of the same lease runs those the first one skipped, into another OUT_DIR.

============  ==================================================================  ===============
stage         what                                                                writes
============  ==================================================================  ===============
device        the GPU, driver, CUDA runtime, CuPy, PyTorch (nvidia-smi too)       (summary.txt)
primitives    the warp primitives (mma.sync, ldmatrix, shuffles, cp.async) and,   (summary.txt)
              on compute capability 9.0, the warpgroup's (wgmma from 128-byte-
              swizzled tiles), against their layouts: a layout mistake shows first
kernel-tests  the GPU tests of the CUDA kernels and of training (CUDA graphs)     gpu_tests.log
steps         training steps on CuPy and PyTorch: GPT-2 124M (float32, float16    steps.md, .json
              mixed precision, eager and from a CUDA graph), gpt-medium eager
              and from a CUDA graph; PyTorch
              three ways: nanoGPT's structure eager (torch), nn.TransformerEncoder-
              Layer blocks (torch-layers), nanoGPT's under torch.compile (torch-
              compile, the GPT steps; its compile time apart, in the json)
sweep         attention at T = 128 .. 8192, plain and flash (float16 too), and    sweep.md, .json
              flash at training shapes (B H >= 32, T 1024-8192, D 64 and 128,
              float16 and float32), beside PyTorch's SDPA
ncu           Nsight Compute on the float16 flash kernels, B4 H16 T4096 D 64       profile.txt
              and 128 (benchmarks/flash_profile.py): each kernel's time,
              registers, occupancy, issue slots, instructions run per HMMA
other-tests   the rest of the GPU tests (ops, modules, models, ...)               (gpu_tests.log)
cpu-vs-gpu    the op cases and the gpt-small step with NumPy on this machine's    cpu_vs_gpu.md
              CPU cores beside CuPy (the report's "GPU speed-up" column)
profile       the kernels of a GPT-2 124M training step, float32 and float16      (profile.txt,
              mixed precision, npformer's and PyTorch's (count, time, top)        appended)
============  ==================================================================  ===============

Eight files at most come back from a GPU lease, and these are eight, directly in OUT_DIR:
summary.txt holds the device facts, a line per stage (exit status, seconds, or why it was skipped),
every failed or erroring test by name, and the tail of a failed stage's output; it is printed last.
The two test stages run in parallel (xdist) with a per-test timeout and report their 15 slowest
tests (the model gradient checks' budget is set from them). The exit status is 1 when a stage
failed or was skipped, 0 otherwise. The machine needs CuPy, PyTorch with CUDA, pytest-xdist,
pytest-timeout and Nsight Compute's ncu; nothing is installed. A stage that runs past its time is
killed with every process it started (:func:`run_command`).
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARGIN_S = 10          # kept back from a stage's timeout for its files and the summary
REAP_S = 10            # after a stage's process group is killed, the wait for the rest of its output
TAIL_LINES = 12        # of a failed stage's output, in the summary

__all__ = ["Stage", "Outcome", "stages", "run_command", "run_stages", "failing_tests", "summary", "main"]


@dataclass(frozen=True)
class Stage:
    name: str
    minimum_s: float            # the least time in which it gives a useful result (else: skipped)
    cap_s: float                # the most it may take
    command: tuple              # argv; "{out}" is replaced by the output folder, "{timeout}" by the per-test cap,
                                # "{seconds}" by the stage's own timeout less MARGIN_S
    log: str | None = None      # the file (in OUT) its output goes to, appended to; None: kept for the summary
    keep: tuple = ()            # (produced path relative to OUT, name to keep it as) after it ends


@dataclass
class Outcome:
    name: str
    status: str                 # "ok", "failed (exit N)", "timed out", "skipped: ..."
    seconds: float
    tail: str = ""
    failures: tuple = ()        # pytest's "FAILED ..." and "ERROR ..." lines: each failing test by name


KERNEL_TESTS = ("tests/kernels/cuda", "tests/training")      # the kernel-tests stage; other-tests runs the rest
DEVICE_LOG = "device.txt"                                     # merged into summary.txt at the end


def stages(python: str = sys.executable, jobs: int | None = None) -> list[Stage]:
    jobs = jobs or os.cpu_count() or 1
    bench = (python, "benchmarks/run.py", "--paths", "fast", "--skip-parity")
    gpu_vs_torch = bench + ("--backends", "cupy,torch")
    device = (python, "-c", "import benchmarks.gpu_check as g; g.device_facts()")
    pytest = (python, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider")
    parallel = pytest + ("-n", str(jobs), "--timeout={timeout}", "--durations=15", "-p", "no:benchmark")
    ops = "linear,softmax,layer_norm,gelu,attention,multi_head,ffn,cross_entropy,dropout"
    return [
        Stage("device", 5, 60, device, log=DEVICE_LOG),
        Stage("primitives", 10, 60, pytest + ("tests/kernels/cuda/test_warp_primitives.py",
                                              "tests/kernels/cuda/test_warpgroup_primitives.py")),
        Stage("kernel-tests", 60, 240, parallel + KERNEL_TESTS, log="gpu_tests.log"),
        Stage("steps", 90, 360, bench + ("--backends", "cupy,torch,torch-layers,torch-compile",
                                         "--only", "gpt2-124m,gpt2-124m-fp16,gpt2-124m-fp16-graph,gpt-medium,"
                                         "gpt-medium-graph",
                                         "--out", "{out}/steps"),
              keep=(("steps/*.md", "steps.md"), ("steps/*.json", "steps.json"))),
        Stage("sweep", 45, 240, gpu_vs_torch + ("--only", "sweep,flash-train", "--out", "{out}/sweep"),
              keep=(("sweep/*.md", "sweep.md"), ("sweep/*.json", "sweep.json"))),
        Stage("ncu", 45, 180, (python, "benchmarks/flash_profile.py", "{out}/profile.txt",
                                         "--timeout", "{seconds}")),
        Stage("other-tests", 60, 300, parallel + tuple(f"--ignore={t}" for t in KERNEL_TESTS) + ("tests",),
              log="gpu_tests.log"),
        Stage("cpu-vs-gpu", 60, 180, bench + ("--backends", "numpy,cupy", "--only", ops + ",gpt-small",
                                              "--out", "{out}/cpu_vs_gpu"),
              keep=(("cpu_vs_gpu/*.md", "cpu_vs_gpu.md"),)),
        Stage("profile", 20, 120, (python, "benchmarks/profile_step.py"), log="profile.txt"),
    ]


def device_facts() -> None:
    """The device stage's report (stdout)."""
    import platform
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi"], check=False)
    else:
        print("nvidia-smi: not on the PATH")
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print("GPU:", props["name"].decode(), "| memory", props["totalGlobalMem"] // 2**20, "MiB | SMs",
          props["multiProcessorCount"], "| compute capability", f"{props['major']}.{props['minor']}")
    print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver", cupy.cuda.runtime.driverGetVersion())
    print("CuPy", cupy.__version__, "| Python", platform.python_version())
    try:
        import torch
        print("PyTorch", torch.__version__, "| CUDA available", torch.cuda.is_available())
    except ImportError:
        print("PyTorch: not installed (the reference columns and the kernel profile need it)")
    from npformer.bench.suite import source_commit
    print("npformer commit", source_commit(ROOT))


def run_command(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``argv`` in the checkout (its ``npformer`` first on the path) in a process group of its own;
    (exit status, or None when it ran past ``timeout`` seconds, its output). A command that runs past its
    time is killed with every process it started (pytest's workers, ncu's profiled program), so none of
    them is left holding the GPU while the next stage runs."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HYPOTHESIS_PROFILE=os.environ.get("HYPOTHESIS_PROFILE", "ci"))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out + err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=REAP_S)
        except subprocess.TimeoutExpired as exc:         # a process that left the group holds the pipes
            proc.wait()
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                        for x in (exc.stdout, exc.stderr))
        return None, out + err


def _execute(argv: list[str], timeout: float, log_path: str | None) -> tuple[int | None, str]:
    """Run ``argv`` (:func:`run_command`), its output appended to ``log_path`` if given."""
    code, output = run_command(argv, timeout)
    if log_path:
        with open(log_path, "a") as f:
            f.write(output)
    return code, output


def run_stages(out: str, plan: list[Stage], budget: float | None,
               clock: Callable[[], float] = time.monotonic,
               execute: Callable[[list[str], float, str | None], tuple[int | None, str]] = _execute,
               log: Callable[[str], None] = print) -> list[Outcome]:
    """Run ``plan`` in order within ``budget`` seconds (None: each stage to its cap); returns the outcomes.

    A stage starts only if ``minimum_s`` + MARGIN_S is left; its timeout is the smaller of its cap
    and what is left less MARGIN_S. ``clock`` and ``execute`` are parameters for the tests."""
    start, outcomes = clock(), []
    for stage in plan:
        left = None if budget is None else budget - (clock() - start)
        if left is not None and left < stage.minimum_s + MARGIN_S:
            need = stage.minimum_s + MARGIN_S
            outcomes.append(Outcome(stage.name, f"skipped: needs {need:.0f} s, {max(left, 0):.0f} s left", 0.0))
            log(f"{stage.name}: skipped ({max(left, 0):.0f} s of the budget left)")
            continue
        timeout = stage.cap_s if left is None else min(stage.cap_s, left - MARGIN_S)
        per_test = max(30, min(300, int(timeout / 3)))
        argv = [arg.replace("{out}", out).replace("{timeout}", str(per_test))
                .replace("{seconds}", str(int(timeout - MARGIN_S))) for arg in stage.command]
        log(f"{stage.name}: running (up to {timeout:.0f} s)")
        began = clock()
        code, output = execute(argv, timeout, os.path.join(out, stage.log) if stage.log else None)
        seconds = clock() - began
        _keep(out, stage)
        status = "ok" if code == 0 else "timed out" if code is None else f"failed (exit {code})"
        tail = "" if code == 0 else "\n".join(output.strip().splitlines()[-TAIL_LINES:])
        outcomes.append(Outcome(stage.name, status, seconds, tail, failing_tests(output)))
        log(f"{stage.name}: {status} in {seconds:.0f} s")
    return outcomes


def _keep(out: str, stage: Stage) -> None:
    """Move a stage's kept files to OUT's top level and remove the folder they came from."""
    folders = set()
    for pattern, name in stage.keep:
        found = sorted(glob.glob(os.path.join(out, pattern)))
        if found:
            shutil.move(found[-1], os.path.join(out, name))
        folders.add(os.path.join(out, pattern.split("/")[0]))
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def failing_tests(output: str) -> tuple:
    """pytest's short summary lines of ``output`` that name a failed or erroring test (``-rfE``)."""
    return tuple(line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR ")))


def summary(outcomes: list[Outcome], budget: float | None, device: str = "") -> str:
    """The device facts, then a line per stage, each failing test by name under its stage, and the
    tail of a failed stage's output."""
    lines = ([device.rstrip(), ""] if device.strip() else []) + [
        f"gpu_check: budget {'none' if budget is None else f'{budget:.0f} s'}, "
        f"{sum(o.seconds for o in outcomes):.0f} s in the stages"]
    for o in outcomes:
        lines.append(f"{o.name:<12} {o.status}" + (f" in {o.seconds:.0f} s" if not o.status.startswith("skipped")
                                                       else ""))
        lines += ["    " + f for f in o.failures]
        lines += ["    " + t for t in o.tail.splitlines() if t not in o.failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bash benchmarks/gpu_check.sh", description=__doc__.split("\n")[0])
    ap.add_argument("out", metavar="OUT_DIR", help="output folder (made if missing)")
    ap.add_argument("--budget", type=float, metavar="SECONDS",
                    help="seconds for all the stages (480 fits a 10-minute GPU call)")
    ap.add_argument("--jobs", type=int, metavar="N", help="test workers (default: the CPU count)")
    ap.add_argument("--only", metavar="STAGES", help="comma list of stages to run, in their order (a second call "
                                                     "of a lease: the stages the first one skipped)")
    args = ap.parse_args(argv)
    if args.budget is not None and args.budget <= 0:
        ap.error(f"--budget: expected a positive number of seconds, got {args.budget:g}")
    plan = stages(jobs=args.jobs)
    if args.only:
        only, names = args.only.split(","), [s.name for s in plan]
        unknown = [n for n in only if n not in names]
        if unknown:
            ap.error(f"--only: unknown stage {', '.join(unknown)}; the stages are {', '.join(names)}")
        plan = [s for s in plan if s.name in only or s.name == "device"]   # the device facts (first), always
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    outcomes = run_stages(out, plan, args.budget, clock=time.monotonic, execute=_execute)
    device_log = os.path.join(out, DEVICE_LOG)
    device = open(device_log).read() if os.path.exists(device_log) else ""
    if os.path.exists(device_log):
        os.remove(device_log)                     # into summary.txt: eight files come back from a lease
    text = summary(outcomes, args.budget, device)
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
