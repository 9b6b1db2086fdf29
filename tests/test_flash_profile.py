"""benchmarks/flash_profile.py, the Nsight Compute run of the flash kernels, without a GPU: the probe's cases
on NumPy, the raw-page parser and table, the ncu command, and the whole run against a stand-in ncu that runs
the probe on the CPU and answers the imports with a raw page in ncu's format."""
from __future__ import annotations

import csv
import io
import os
import re
import stat
import sys

import pytest

from benchmarks import flash_profile

FWD = "void npf_fa_kernel<NpfFaFwdDense<unsigned short, 64, true>>(NpfFaParams<unsigned short, float>)"
PRE = "void npf_fa_kernel<NpfFaPre<unsigned short>>(NpfFaParams<unsigned short, float>)"
LAUNCH = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream", "Block Size",
          "Grid Size", "Device", "CC"]
METRICS = ["gpu__time_duration.sum", "launch__registers_per_thread", "sm__maximum_warps_per_active_cycle_pct",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "smsp__inst_executed.sum", "sm__inst_executed_pipe_tensor_op_hmma.sum"]


def _raw_page() -> str:
    """``ncu --import R --page raw --csv --print-units base`` as ncu writes it: its own lines first, the
    header, a row of units, then a row per launch, every field quoted, counts with thousands separators."""
    rows = [LAUNCH + METRICS, [""] * len(LAUNCH) + ["nsecond", "register/thread", "%", "%", "%", "inst", "inst"],
            ["0", "566", "python3.12", "127.0.0.1", FWD, "1", "7", "(128, 1, 1)", "(32, 64, 1)", "0", "9.0",
             "2,370,500", "128", "25", "24.61", "55.72", "18,874,368", "3,145,728"],
            ["1", "566", "python3.12", "127.0.0.1", PRE, "1", "7", "(256, 1, 1)", "(2048, 1, 1)", "0", "9.0",
             "41,000", "32", "100", "80.5", "20.1", "1,000,000", "0"]]
    text = io.StringIO()
    csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n").writerows(rows)
    return "==PROF== Connected to process 566\n" + text.getvalue()


RAW_PAGE = _raw_page()


def test_the_probe_runs_every_case_forward_and_backward_on_the_cpu():
    """The probe's cases at the small shape on NumPy (float16, as on the GPU): what the GPU run executes
    under ncu, so an API change breaks it here first."""
    lines = []
    assert flash_profile.probe("numpy", small=True, log=lines.append) == len(flash_profile.CASES)
    assert lines == [f"profiled: float16 B1 H2 T80 D{c.D}" + (" causal" if c.causal else "")
                     for c in flash_profile.CASES]


def test_the_raw_page_gives_a_row_per_launch_with_instructions_per_hmma():
    rows = flash_profile.read_raw_csv(RAW_PAGE)
    assert [r["ID"] for r in rows] == ["0", "1"]                        # ncu's line and the units row left out
    lines = flash_profile.table(rows, {"NpfFaFwdDense<unsignedshort,64,true>": "5.3"}).splitlines()
    assert lines[0].endswith("| per HMMA | SASS loop per HMMA |") and len(lines) == 4
    fwd = [c.strip() for c in lines[2].strip("|").split("|")]
    assert fwd[:2] == ["NpfFaFwdDense<unsigned short, 64, true>", "(32, 64, 1) x (128, 1, 1)"]
    # time in us from base nanoseconds, registers, occupancy, achieved, issue, tensor pipe (not asked), counts,
    # their ratio, the SASS's
    assert fwd[2:] == ["2370.5", "128", "25.0", "24.6", "55.7", "-", "18874368", "3145728", "6.00", "5.3"]
    assert lines[3].rstrip(" |").endswith("| 0 | - | -")               # bwd_pre: no HMMA, no ratio, no loop
    assert flash_profile.read_raw_csv("==ERROR== no kernels were profiled") == []


def test_the_sass_figures_are_the_committed_reports_by_the_kernels_ncu_names():
    """benchmarks/cuda_kernels.py's main-loop column, per architecture, keyed as ncu names a launch (its
    traits, spaces dropped): every dense and Hopper float16 and bfloat16 kernel at head sizes 64 and 128, at
    most 6 (what test_compile.py holds them to); none for an architecture without a report."""
    from npformer.kernels.cuda.runtime import shipped_modules
    names = {e.removeprefix("npf_fa_kernel<")[:-1].replace(" ", "") for m in shipped_modules().values()
             for n, e in m.kernels.items() if re.search(r"_(dense|wgmma).*_d(64|128)_b?f16$", n)}
    for arch in (80, 90):
        sass = flash_profile.sass_per_hmma(arch)
        wanted = {n for n in names if arch == 90 or "Wgmma" not in n}
        assert wanted <= set(sass) and all(float(sass[n]) <= 6 for n in wanted), arch
    assert flash_profile.sass_per_hmma(75) == {}


def test_the_details_pages_long_form_is_read_a_launch_a_row():
    """Should an ncu give its details page's form (a row per metric), each launch's rows are gathered by ID."""
    head = LAUNCH + ["Section Name", "Metric Name", "Metric Unit", "Metric Value"]
    launch = ["0", "566", "python3.12", "127.0.0.1", FWD, "1", "7", "(128, 1, 1)", "(32, 64, 1)", "0", "9.0"]
    metrics = [("GPU Speed Of Light Throughput", "gpu__time_duration.sum", "nsecond", "2,370,500"),
               ("Command line profiler metrics", "smsp__inst_executed.sum", "inst", "18,874,368"),
               ("Command line profiler metrics", "sm__inst_executed_pipe_tensor_op_hmma.sum", "inst", "3,145,728")]
    text = io.StringIO()
    csv.writer(text, quoting=csv.QUOTE_ALL, lineterminator="\n").writerows([head] + [launch + list(m) for m in metrics])
    (row,) = flash_profile.read_raw_csv(text.getvalue())
    assert row["Kernel Name"] == FWD and row["smsp__inst_executed.sum"] == "18,874,368"
    assert "Metric Value" not in row and flash_profile.table([row]).splitlines()[2].endswith("| 6.00 | - |")


def test_the_ncu_command_asks_for_the_metrics_this_ncu_knows_and_profiles_the_probe_in_its_range():
    known = flash_profile.known_metrics("Device NVIDIA H200\nMetric Name   Metric Description\n"
                                        "smsp__inst_executed   # of warp instructions executed\n"
                                        "gpu__time_duration   total duration in nanoseconds\n")
    assert known == {"smsp__inst_executed", "gpu__time_duration"}
    argv = flash_profile.ncu_command("ncu", "/tmp/r", known)
    assert argv[:3] == ["ncu", "--profile-from-start", "off"] and argv[-2:] == [flash_profile.__file__, "--probe"]
    assert argv[argv.index("--metrics") + 1] == "gpu__time_duration.sum,smsp__inst_executed.sum"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--section"] == list(flash_profile.SECTIONS)
    every = flash_profile.ncu_command("ncu", "/tmp/r", None)              # the query failed: ask for them all
    assert every[every.index("--metrics") + 1].split(",") == list(flash_profile.WANTED_METRICS)


STAND_IN = '''#!{python}
"""ncu's stand-in: the query, the version, a profiled run (the probe on the CPU) and the two imports."""
import subprocess, sys
args = sys.argv[1:]
if args == ["--query-metrics"]:
    print("Metric Name  Metric Description\\nsmsp__inst_executed  warp instructions\\n"
          "sm__inst_executed_pipe_tensor_op_hmma  HMMA")
elif args == ["--version"]:
    print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2099.1.0.0 (stand-in)")
elif args[0] == "--import":
    print({raw!r} if "raw" in args else "  npf_fa_kernel ... Section: GPU Speed Of Light Throughput")
else:
    report = args[args.index("--export") + 1]
    target = args[args.index("{python}"):]
    done = subprocess.run(target + ["--backend", "numpy", "--small"])
    if done.returncode == 0:
        open(report + ".ncu-rep", "w").close()
    sys.exit(done.returncode)
'''


def _stand_in(tmp_path, replace: tuple = ()):
    """The stand-in ncu as an executable in ``tmp_path``, with ``replace`` (old, new) applied to its text."""
    text = STAND_IN.format(python=sys.executable, raw=RAW_PAGE)
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    path = tmp_path / "ncu"
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_whole_run_against_a_stand_in_ncu_writes_the_table_and_ncus_report(tmp_path, capsys):
    out = tmp_path / "lease" / "profile.txt"
    assert flash_profile.main([str(out), "--ncu", _stand_in(tmp_path), "--timeout", "120"]) == 0
    text = out.read_text()
    assert "Version 2099.1.0.0 (stand-in)" in text
    # the query listed two of the wanted metrics: the others are named as not asked for
    assert "not asked for): gpu__time_duration.sum, launch__registers_per_thread" in text
    assert ("--metrics sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,"
            "smsp__inst_executed.sum,sm__inst_executed_pipe_tensor_op_hmma.sum ") in text
    assert [line for line in text.splitlines() if line.startswith("profiled:")] == [
        "profiled: float16 B1 H2 T80 D64 causal", "profiled: float16 B1 H2 T80 D64",
        "profiled: float16 B1 H2 T80 D128 causal"]
    assert "| NpfFaFwdDense<unsigned short, 64, true> |" in text and "| 6.00 |" in text
    # beside ncu's ratio, the SASS's for the device's compute capability (the raw page's CC, 9.0)
    fwd = next(line for line in text.splitlines() if line.startswith("| NpfFaFwdDense<unsigned short, 64, true>"))
    assert fwd.endswith(f"| 6.00 | {flash_profile.sass_per_hmma(90)['NpfFaFwdDense<unsignedshort,64,true>']} |")
    assert text.rstrip().endswith("Section: GPU Speed Of Light Throughput")
    shown = capsys.readouterr().out
    assert "| 6.00 |" in shown and "Speed Of Light" not in shown            # the table printed, not ncu's report


def test_a_report_that_cannot_be_read_costs_the_column_not_the_measurements(tmp_path, monkeypatch):
    def unreadable(arch, results=None):
        raise OSError("cuda-kernels-sm90.md: unreadable")
    monkeypatch.setattr(flash_profile, "sass_per_hmma", unreadable)
    out = tmp_path / "profile.txt"
    assert flash_profile.main([str(out), "--ncu", _stand_in(tmp_path), "--timeout", "120"]) == 0
    text = out.read_text()
    assert "the SASS's figures could not be read: OSError: cuda-kernels-sm90.md: unreadable" in text
    assert "| 6.00 | - |" in text


def test_a_failed_profile_is_written_with_ncus_output_and_fails(tmp_path):
    script = _stand_in(tmp_path, ('done = subprocess.run(target + ["--backend", "numpy", "--small"])',
                                  'print("==ERROR== ERR_NVGPUCTRPERM"); sys.exit(7)'))
    out = tmp_path / "profile.txt"
    assert flash_profile.main([str(out), "--ncu", script]) == 1
    text = out.read_text()
    assert "ncu failed (exit 7), no report:" in text and "ERR_NVGPUCTRPERM" in text


def test_a_probe_that_fails_after_some_launches_keeps_them_and_says_so(tmp_path):
    """The Hopper kernels run after the dense ones: if the probe dies there, ncu still writes the launches
    it profiled, and the report gives them with the failure's output."""
    script = _stand_in(tmp_path, ("    sys.exit(done.returncode)",
                                  "    print('RuntimeError: wgmma went wrong'); sys.exit(1)"))
    out = tmp_path / "profile.txt"
    assert flash_profile.main([str(out), "--ncu", script]) == 1
    text = out.read_text()
    assert "ncu failed (exit 1); the launches below are those profiled before it." in text
    assert "RuntimeError: wgmma went wrong" in text and "| 6.00 |" in text


def test_without_ncu_it_says_so_and_how_to_name_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(flash_profile.shutil, "which", lambda name: None)
    assert flash_profile.main([str(tmp_path / "p.txt")]) == 2
    assert "ncu (Nsight Compute) is not on the PATH; give --ncu PATH" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "p.txt")
    with pytest.raises(SystemExit):
        flash_profile.main([])                                               # neither OUT_FILE nor --probe
