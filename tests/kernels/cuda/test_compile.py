"""NVIDIA's own compiler on every CUDA module npformer ships (benchmarks/cuda_kernels.py), for the
A100's sm_80 and the H100's sm_90, with the options CuPy compiles them with, and no GPU: no warning,
no spill and no stack, every launch fits its kernel, every kernel keeps the occupancy it states, and
the float16 and bfloat16 attention kernels (and float32's under the TF32 opt-in) use tensor cores,
bfloat16's through bfloat16 products (HMMA.16816.F32.BF16).

Skipped with the reason where the compiler wheels are absent (CI stage 3 installs them:
nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12, nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm)."""
import os
import re
import subprocess

import pytest

from benchmarks import cuda_kernels
from npformer.kernels.cuda import runtime

NO_TOOLS = ("NVIDIA's compiler wheels are not installed (pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 "
            "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): the compile checks need NVRTC, ptxas, cuobjdump, nvdisasm")


@pytest.fixture(scope="module")
def tools():
    found = cuda_kernels.find_tools()
    if found is None:
        pytest.skip(NO_TOOLS)
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """Where the compiled modules stay: ``<module>_<arch>.cubin`` (cuda_kernels.compile_module's names)."""
    return tmp_path_factory.mktemp("npf_compiled")


@pytest.fixture(scope="module")
def compiled(tools, workdir):
    """``{arch: (kernels, {module: warnings})}``: every shipped module for sm_80 and sm_90 (compiled once)."""
    return cuda_kernels.compile_all(tools, workdir=str(workdir))


def test_every_module_compiles_for_both_architectures_without_a_warning(compiled):
    for arch, (kernels, warnings) in compiled.items():
        modules = {name for name, module in runtime.shipped_modules().items() if arch in module.archs}
        assert set(warnings) == modules
        assert not any(warnings.values()), {m: w for m, w in warnings.items() if w}
        assert {k.module for k in kernels} == modules, arch


def test_no_kernel_spills_or_uses_a_stack_frame(compiled):
    for arch, (kernels, _) in compiled.items():
        bad = [(k.name, k.spill_stores, k.spill_loads, k.stack) for k in kernels
               if k.spill_stores or k.spill_loads or k.stack]
        assert not bad, f"sm_{arch}: {bad}"


def test_every_launch_fits_its_kernel(compiled):
    """The launcher's block size and shared memory are within what the kernel's resources allow:
    at least one block fits an SM (registers x threads, shared memory under the per-block maximum)."""
    for arch, (kernels, _) in compiled.items():
        for k in kernels:
            assert 1 <= k.threads <= 1024 and k.threads % 32 in (0, k.threads), k.name
            assert k.occupancy > 0, f"sm_{arch} {k.name}: no block fits ({k.limit})"


def test_every_kernel_keeps_the_occupancy_it_states(compiled):
    for arch, (kernels, _) in compiled.items():
        below = [(k.name, f"{k.occupancy:.4f} < {floor}", k.limit) for k in kernels
                 if k.occupancy < (floor := cuda_kernels.occupancy_floor(k.name, arch))]
        assert not below, f"sm_{arch}: {below}"


def test_the_float_kernels_flush_float32_denormals_as_their_docstrings_say(tools):
    """CuPy appends -ftz=true after npformer's options (NVRTC: the last one wins), so float32
    arithmetic flushes denormals: the optimiser's float32 update uses .ftz instructions, its float64
    arithmetic none (the flush is float32's only), as kernels/cuda/optim.py states."""
    common = runtime.shipped_modules()[runtime.COMMON_MODULE]
    source, options = common.source, common.options
    options = tuple(options) + cuda_kernels.CUPY_OPTIONS + ("-arch=compute_90",)
    ptx, _, _ = cuda_kernels.nvrtc_ptx(tools, source, options)
    bodies = dict(re.findall(r"\.entry (npf_adam_update_f\d\d)\((.*?)\n}\n", ptx, re.S))
    assert {"add.rn.ftz.f32", "mul.rn.ftz.f32", "div.rn.ftz.f32", "sqrt.rn.ftz.f32"} <= set(
        re.findall(r"\b[a-z]+\.rn\.ftz\.f32\b", bodies["npf_adam_update_f32"]))
    assert "add.rn.f64" in bodies["npf_adam_update_f64"] and not re.search(r"ftz\.f64", bodies["npf_adam_update_f64"])


@pytest.mark.parametrize("suffix", ["f16", "bf16"])
def test_the_16_bit_attention_kernels_run_on_tensor_cores(compiled, suffix):
    """The kernels float16 and bfloat16 take from sm_80 on (npf_fa_forward_tc, npf_fa_bwd_dq_tc,
    npf_fa_bwd_dkdv_tc): mma.sync (HMMA) and ldmatrix (LDSM), the forward's row statistics by shuffles and
    its K and V tiles by cp.async (LDGSTS); the forward at 25% occupancy on sm_90 and the backward at 18.75%
    but for dK/dV at D = 128 (12.5%: its accumulators)."""
    kernels, _ = compiled[90]
    tc = {k.name: k for k in kernels if re.match(rf"npf_fa_(fwd|bwd_dq|bwd_dkdv)_tc_d\d+_{suffix}$", k.name)}
    assert len(tc) == 9 and all(k.mix["HMMA"] > 0 and k.mix["LDSM"] > 0 for k in tc.values()), tc
    forward = [tc[f"npf_fa_fwd_tc_d{d}_{suffix}"] for d in (32, 64, 128)]
    assert all(k.mix["SHFL"] > 0 and k.mix["LDGSTS"] > 0 and k.occupancy >= 0.25 for k in forward), forward
    assert all(k.occupancy >= 0.1875 for name, k in tc.items() if name != f"npf_fa_bwd_dkdv_tc_d128_{suffix}")


def test_the_hopper_kernels_run_on_wgmma_and_issue_few_instructions_per_product(compiled, tools, workdir):
    """The Hopper kernels (npf_fa_{fwd,bwd_dq,bwd_dkdv}_wgmma[_causal]_d{64,128}_{f16,bf16}, sm_90a modules, on
    sm_90 only): their tile products are HGMMA (the forward: 64x128x16 for S, 64xDx16 for O += P V with V
    transposed; dQ: 64x64x16 for S and dP, 64xDx16 for dQ += dS K; dK, dV: 64x64x16 for S^T and dP^T,
    64xDx16 for dV += P^T dO and dK += dS^T Q; bfloat16's .BF16; the pipelined kernels' first and last
    tiles' wgmmas outside the loops: all but dK dV at head size 128), no mma.sync; 256
    threads at 12.5% occupancy; and each main loop (the tiles without masks) issues at most 5 instructions
    per m16n8k16 a warp's share of the wgmmas stands for (the dense mma.sync kernels: 3.8-5.8 per HMMA,
    each HMMA a quarter of the issue rate's product)."""
    assert not any("wgmma" in k.name for k in compiled[80][0])
    kernels = {k.name: k for k in compiled[90][0] if "_wgmma" in k.name}
    assert len(kernels) == 24, sorted(kernels)
    for name, k in kernels.items():
        d = int(re.search(r"_d(\d+)_", name).group(1))
        outside = 0                             # wgmmas outside the loops
        if name.startswith("npf_fa_fwd"):       # S: d / 16 of 64x128x16; O: 128 / 16 of 64xDx16
            hgmma, hmma = d // 16 + 128 // 16, 128 // 8 * (d // 16) + d // 8 * (128 // 16)
            outside = 2 * (d // 16) + 128 // 16     # the first tile's S (masked or not), the last tile's O
        elif name.startswith("npf_fa_bwd_dq"):  # S, dP: 2 d / 16 of 64x64x16; dQ: 64 / 16 of 64xDx16
            hgmma, hmma = 2 * (d // 16) + 64 // 16, 2 * 64 // 8 * (d // 16) + d // 8 * (64 // 16)
            outside = 2 * 2 * (d // 16) + 64 // 16  # the first tile's S and dP (masked or not), the last tile's dQ
        else:                                   # S^T, dP^T: 2 d / 16 of 64x64x16; dV, dK: 2 x 64 / 16 of 64xDx16
            hgmma, hmma = 2 * (d // 16) + 2 * (64 // 16), 2 * 64 // 8 * (d // 16) + 2 * d // 8 * (64 // 16)
            if d == 64:     # pipelined: the first tile's S^T and dP^T (masked or not), the last tile's dV, dK
                outside = (2 if "causal" in name else 1) * 2 * (d // 16) + 2 * (64 // 16)
        loops = 1 if "dkdv" in name and "causal" not in name else 2    # a loop for the masked tiles too, but
        assert k.mix["HGMMA"] == loops * hgmma + outside, (name, k.mix)     # not dK dV's without causal
        assert k.mix["HMMA"] == 0, (name, k.mix)
        assert k.threads == 256 and k.occupancy == 0.125, (name, k.threads, k.occupancy)
        assert k.loop["HMMA"] == hmma, (name, k.loop)
        assert k.loop["total"] <= 5 * k.loop["HMMA"], (name, round(k.loop["total"] / k.loop["HMMA"], 1))
    for suffix, kind in (("f16", ""), ("bf16", ".BF16")):
        for d in (64, 128):
            sass = subprocess.run([tools.cuobjdump, "-sass", str(workdir / f"flash_{suffix}_d{d}_sm90a_90.cubin")],
                                  capture_output=True, text=True, check=True,
                                  env=dict(os.environ, NVDISASM_PATH=os.path.dirname(tools.nvdisasm))).stdout
            shapes = set(re.findall(r"HGMMA\.(64x\d+x16\.F32(?:\.BF16)?) [^;]*?gdesc\[UR\d+\](\.tnspB)?", sass))
            want = {(f"64x{n}x16.F32{kind}", "") for n in (128, 64)} | {(f"64x{d}x16.F32{kind}", ".tnspB")}
            assert shapes == want, (suffix, d, shapes)


def test_bfloat16_kernels_are_float16_s_with_bfloat16_products(compiled, tools, workdir):
    """Every bfloat16 flash kernel on both architectures: each HMMA multiplies bfloat16
    (HMMA.16816.F32.BF16, none of float16's), and it is float16's kernel otherwise: the same HMMA, LDSM
    and LDGSTS counts, registers and occupancy (the same tiles, launch bounds and shared memory)."""
    for arch in cuda_kernels.ARCHS:
        kernels = {k.name: k for k in compiled[arch][0]}
        bf16 = [name for name in kernels if name.startswith("npf_fa_") and name.endswith("_bf16")]
        assert len(bf16) == len([name for name in kernels if name.startswith("npf_fa_") and name.endswith("_f16")])
        for name in bf16:
            k, f16 = kernels[name], kernels[name[:-len("bf16")] + "f16"]
            same = ("HMMA", "LDSM", "LDGSTS")
            assert [k.mix[op] for op in same] == [f16.mix[op] for op in same], (arch, name, k.mix, f16.mix)
            assert (k.registers, k.occupancy) == (f16.registers, f16.occupancy), (arch, name)
        for d in (32, 64, 128):
            cubin = workdir / f"flash_bf16_d{d}_{arch}.cubin"
            sass = subprocess.run([tools.cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True,
                                  env=dict(os.environ, NVDISASM_PATH=os.path.dirname(tools.nvdisasm))).stdout
            hmma = re.findall(r"\bHMMA\.[\w.]+", sass)
            assert hmma and set(hmma) == {"HMMA.16816.F32.BF16"}, (arch, d, sorted(set(hmma)))


def test_float32_under_tf32_runs_on_tensor_cores(compiled):
    """The float32 kernels of the TF32 opt-in (npf_fa_*_tf32): TF32 mma.sync (HMMA) on both architectures,
    every tile through cp.async (LDGSTS), no ldmatrix (32-bit operands are read a value a lane)."""
    for arch in cuda_kernels.ARCHS:
        kernels, _ = compiled[arch]
        tf32 = {k.name: k for k in kernels if re.match(r"npf_fa_(fwd|bwd_dq|bwd_dkdv)_tf32_d\d+_f32$", k.name)}
        assert len(tf32) == 9, (arch, sorted(tf32))
        assert all(k.mix["HMMA"] > 0 and k.mix["LDGSTS"] > 0 and not k.mix["LDSM"] for k in tf32.values()), tf32


def test_block_sizes_and_floors_are_known_for_every_entry_point():
    """Without the compiler: every kernel of every module (extern "C", or a named instantiation) has a
    launch block size and an occupancy floor, so the table cannot silently miss one."""
    for name, module in runtime.shipped_modules().items():
        entries = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(', module.source)
        for entry in entries + list(module.kernels):
            assert cuda_kernels.block_threads(entry) >= 1, entry
            for arch in module.archs:
                floor = cuda_kernels.occupancy_floor(entry, arch)
                assert 0 < floor <= 1, (entry, arch)


def test_the_warp_primitives_compile_to_the_instructions_they_stand_for(tools, tmp_path):
    """mma.sync to HMMA (float16, bfloat16 and TF32), ldmatrix to LDSM, cp.async to LDGSTS, the shuffle to SHFL,
    for both architectures (the test kernels of tests/kernels/cuda/warp_test.cu, a warp each; the
    cp.async one two)."""
    from tests.kernels.cuda.sources import PRIMITIVES_NVRTC_OPTIONS, PRIMITIVES_SOURCE
    threads = {name: 64 if name == "npf_test_cp_async" else 32
               for name in re.findall(r'extern "C" __global__ void (\w+)\(', PRIMITIVES_SOURCE)}
    for arch in cuda_kernels.ARCHS:
        kernels, warnings = cuda_kernels.compile_module(tools, "primitives", PRIMITIVES_SOURCE,
                                                        PRIMITIVES_NVRTC_OPTIONS, arch, str(tmp_path), threads)
        assert not warnings and not any(k.spill_stores or k.stack for k in kernels.values()), arch
        mix = {name: k.mix for name, k in kernels.items()}
        assert mix["npf_test_mma"]["HMMA"] >= 1 and mix["npf_test_ldmatrix"]["LDSM"] >= 1, (arch, mix)
        assert mix["npf_test_mma_tf32"]["HMMA"] >= 1 and mix["npf_test_mma_bf16"]["HMMA"] >= 1, (arch, mix)
        assert mix["npf_test_cp_async"]["LDGSTS"] >= 1 and mix["npf_test_shfl"]["SHFL"] >= 2, (arch, mix)


def test_the_warpgroup_primitives_compile_to_hgmma_for_sm_90a(tools, tmp_path):
    """wgmma to HGMMA (64x64x16 and 64x128x16, float16 and bfloat16, A from shared memory or registers, B
    transposed where asked: .tnspB), the fence to WARPGROUP.ARRIVE, the wait to WARPGROUP.DEPBAR, the proxy
    fence to FENCE.VIEW.ASYNC.S: the test kernels of tests/kernels/cuda/warpgroup_test.cu, one warpgroup
    each, compiled for sm_90a as the GPU run compiles them, with no warning (ptxas says when it must
    serialise wgmmas or insert its own arrives), spill or stack."""
    from tests.kernels.cuda.sources import WARPGROUP_TEST_KERNELS, WARPGROUP_TEST_OPTIONS, WARPGROUP_TEST_SOURCE
    instances = {expression: expression for expression in WARPGROUP_TEST_KERNELS}
    kernels, warnings = cuda_kernels.compile_module(tools, "warpgroup", WARPGROUP_TEST_SOURCE, WARPGROUP_TEST_OPTIONS,
                                                    90, str(tmp_path), dict.fromkeys(instances, 128), instances)
    assert not warnings and set(kernels) == set(instances)
    assert not any(k.spill_stores or k.stack for k in kernels.values())
    sass = subprocess.run([tools.cuobjdump, "-sass", str(tmp_path / "warpgroup_90.cubin")], capture_output=True,
                          text=True, check=True, env=dict(os.environ, NVDISASM_PATH=os.path.dirname(tools.nvdisasm)))
    functions = sass.stdout.split("Function : ")[1:]
    assert len(functions) == len(instances)
    mangled = re.compile(r"_Z14npf_test_wgmmaILi(\d+)ELi(\d+)ELb(\d)ELi(\d)ELb(\d)E")  # <N, K, RS, TRANS_B, BF16>
    hgmma = re.compile(r"HGMMA\.64x(\d+)x16\.F32(\.BF16)? R\d+, (R\d+, )?gdesc\[UR\d+\](\.tnspB)?")
    for function in functions:
        n, k, rs, trans_b, bf16 = mangled.match(function).groups()
        found = hgmma.findall(function)
        assert len(found) == int(k) // 16, function[:200]
        for shape, is_bf16, a_registers, transposed in found:
            assert (shape, bool(is_bf16), bool(a_registers), bool(transposed)) == (n, bf16 == "1", rs == "1",
                                                                                    trans_b == "1")
        opcodes = set(re.findall(r"[A-Z][A-Z.]+[A-Z]", function))
        assert {"WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE", "FENCE.VIEW.ASYNC.S"} <= opcodes


def test_the_main_loop_is_the_smallest_loop_holding_the_most_hmma():
    """benchmarks/cuda_kernels.main_loop on a made-up SASS: an outer loop (over heads) around the tile
    loop, both holding its HMMA, and a load loop without HMMA; the tile loop is counted, by pipe,
    its untaken branch's instructions included and NOPs left out, its calls (the callee not counted) and
    cp.async copies apart too; a wgmma loop's HGMMA.64xNx16 count N / 8 HMMA each (a warp's share of the
    warpgroup's product). Needs no compiler."""
    sass = """
        Function : npf_made_up
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS R2, [R3] ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0040*/                   HMMA.16816.F32 R8, R12, R16, R8 ;
        /*0050*/                   FFMA R5, R6, R7, R5 ;
        /*0060*/                   MUFU.EX2 R5, R5 ;
        /*0070*/              @!P1 BRA 0x90 ;
        /*0080*/                   LDSM.16.M88.4 R20, [R21] ;
        /*0090*/                   HMMA.16816.F32 R8, R12, R18, R8 ;
        /*00a0*/                   NOP ;
        /*00b0*/              @!P4 CALL.REL.NOINC 0x120 ;
        /*00c0*/                   LDGSTS.E.BYPASS.128 [R22], desc[UR8][R24.64] ;
        /*00d0*/               @P2 BRA 0x40 ;
        /*00e0*/               @P3 BRA 0x30 ;
        /*00f0*/                   EXIT ;
        /*0100*/                   NOP ;
        /*0110*/                   NOP ;
        /*0120*/                   LDGSTS.E.BYPASS.128 [R22], desc[UR8][R26.64] ;
        /*0130*/                   RET.REL.NODEC R20 0x0 ;
    """
    (instructions,) = cuda_kernels.sass_functions(sass).values()
    assert instructions[4] == (0x40, "HMMA", "R8, R12, R16, R8", ".16816.F32")
    assert cuda_kernels.main_loop(instructions) == {"total": 9, "HMMA": 2, "FMA": 1, "ALU": 0, "XU": 1, "LDS": 1,
                                                    "other": 4, "calls": 1, "copies": 1}
    assert cuda_kernels.main_loop(instructions[:4]) == {}                # a loop, but no HMMA in it
    wgmma = """
        Function : npf_made_up_wgmma
        /*0000*/                   WARPGROUP.ARRIVE ;
        /*0010*/                   HGMMA.64x128x16.F32 R24, gdesc[UR16], RZ, !UPT ;
        /*0020*/                   HGMMA.64x64x16.F32 R88, R24, gdesc[UR12].tnspB, R88, gsb0 ;
        /*0030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0040*/                   FMNMX R2, R2, R3, !PT ;
        /*0050*/               @P0 BRA 0x0 ;
    """
    (instructions,) = cuda_kernels.sass_functions(wgmma).values()
    assert cuda_kernels.main_loop(instructions) == {"total": 6, "HMMA": 16 + 8, "FMA": 0, "ALU": 1, "XU": 0,
                                                    "LDS": 0, "other": 3, "calls": 0, "copies": 0}  # (N / 8 HMMA)


def test_the_dense_attention_kernels_issue_at_most_6_instructions_per_hmma(compiled):
    """The common case's float16 and bfloat16 kernels (npf_fa_*_dense: no masks, no dropout, causal or not) at head
    sizes 64 and 128: their main loops (the tiles that need no mask) copy the next tile in line (NpfFaTilePair:
    its cp.async copies counted, a thread's 16-byte share of two tiles; the one call left is for a ragged last
    tile or unaligned rows) and issue at most 6 instructions per mma.sync, about what keeps Hopper's tensor
    cores busy (the _tc kernels: 19 to 51). The forward at 128 is the closest, at 6.0: its 32-key tiles hold the
    rescale of a lane's 64 outputs, one FMUL per HMMA, counted though it runs only where a row's maximum moved
    (2 fragments a warp spilled, 16-key tiles made 7.7). D 32 has half the products per score, and the same
    softmax work, so it stays above."""
    rows = {"fwd": {64: 64, 128: 32}, "bwd_dq": {64: 32, 128: 32}, "bwd_dkdv": {64: 64, 128: 32}}   # a tile's
    for arch in cuda_kernels.ARCHS:
        kernels, _ = compiled[arch]
        dense = {k.name: k for k in kernels
                 if re.match(r"npf_fa_(fwd|bwd_dq|bwd_dkdv)_dense(_causal)?_d(64|128)_b?f16$", k.name)}
        assert len(dense) == 24, (arch, sorted(dense))
        for name, k in dense.items():
            kind, d = re.match(r"npf_fa_(\w+?)_dense(?:_causal)?_d(\d+)_", name).groups()
            copies = 2 * rows[kind][int(d)] * int(d) * 2 // 16 // 128     # 2 tiles of 16-bit values, 128 threads
            assert k.loop["copies"] == copies, (arch, name, k.loop)
        over = {name: round(k.loop["total"] / k.loop["HMMA"], 2) for name, k in dense.items()
                if k.loop["total"] > 6 * k.loop["HMMA"]}
        assert not over, (arch, over)


def test_float32_s_dense_kernels_keep_little_besides_their_products(compiled):
    """float32's dense kernels (SIMT: npf_fa_*_simt_dense in flash.cu) at every head size, on both
    architectures: the general SIMT kernels' tile products (the same FFMA loops, as many), their tiles copied
    by cp.async (LDGSTS), the forward's row statistics by shuffles, and besides the products at most a fifth
    of the instructions the general kernels' tile loops hold (there every feature's branch counts once: sm_90,
    D 64, 357 against 5457 in the forward; D 128, where the tiles are 32 x 32, 166 against 1847), under 700."""
    for arch in cuda_kernels.ARCHS:
        kernels = {k.name: k for k in compiled[arch][0]}
        for kind in ("fwd", "bwd_dq", "bwd_dkdv"):
            for d in (32, 64, 128):
                general = kernels[f"npf_fa_{kind}_d{d}_f32"]
                for causal in ("", "_causal"):
                    dense = kernels[f"npf_fa_{kind}_dense{causal}_d{d}_f32"]
                    assert dense.tile["products"] == general.tile["products"], (arch, dense.name)
                    assert dense.tile["rest"] < min(700, general.tile["rest"] / 5), (arch, dense.name, dense.tile)
                    assert dense.mix["LDGSTS"] > 0 and not dense.mix["HMMA"], (arch, dense.name)
                    assert kind != "fwd" or dense.mix["SHFL"] > 0, (arch, dense.name)

