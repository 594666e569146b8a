"""The llama.cpp peer's build flags (benchmarks/lib/llamacpp): every instruction set this
CPU reports is compiled in, spelled as /proc/cpuinfo spells it."""

from benchmarks.lib.llamacpp import cmake_args

# A Zen 4's flags as its /proc/cpuinfo lists them (AVX-512 VBMI is "avx512vbmi" there, its
# second version "avx512_vbmi2").
ZEN4 = frozenset(
    "avx avx2 fma f16c avx512f avx512bw avx512vl avx512vbmi avx512_vbmi2 avx512_vnni "
    "avx512_bf16".split()
)


def test_every_instruction_set_the_cpu_reports_is_built():
    args = cmake_args(ZEN4)
    for option in ("AVX", "AVX2", "FMA", "F16C", "AVX512", "AVX512_VBMI", "AVX512_VNNI",
                   "AVX512_BF16"):  # fmt: skip
        assert f"-DGGML_{option}=ON" in args.split(), option
    assert "-DGGML_AVX_VNNI=OFF" in args.split() and "-DGGML_NATIVE=OFF" in args.split()
    assert "-DGGML_AVX512_VBMI=OFF" in cmake_args(ZEN4 - {"avx512vbmi"}).split()
