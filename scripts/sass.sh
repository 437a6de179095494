#!/usr/bin/env bash
# What the compiler made of kernel entry points, with no GPU: registers, local-memory stores and the machine code (SASS).
#
#   bash scripts/sass.sh                    registers and local stores of every entry point (one line each)
#   bash scripts/sass.sh KERNEL [KERNEL..]  the same, then each named entry point's SASS into $OUT_DIR/KERNEL.sass
#
# It compiles the kernels for sm_90a with the pinned NVRTC (scripts/setup_nvrtc.sh) into their own cubin cache and
# disassembles them with nvdisasm from PyPI (`nvidia-cuda-nvdisasm`, installed into the same venv). Reading the SASS
# is how the twelfth session found activation loads the compiler issued one after another (docs/benchmarks.md).
# OUT_DIR: default /tmp/flashplan-sass.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${HOME}/.cache/flashplan-nvrtc"
eval "$(bash scripts/setup_nvrtc.sh "$venv")"
"$venv/bin/python" -m pip install -q --disable-pip-version-check "nvidia-cuda-nvdisasm==13.5.37" >&2
nvdisasm="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/bin/nvdisasm"
chmod +x "$nvdisasm"
out="${OUT_DIR:-/tmp/flashplan-sass}"
rm -rf "$out" && mkdir -p "$out/kernels"
FLASHPLAN_KERNEL_CACHE="$out/kernels" cargo test --release -q -p flashplan-compiler --lib \
    nvrtc::tests::kernels_compile_for_sm_90a >/dev/null
# Registers per entry point from each cubin's .nv.info (EIATTR_REGCOUNT); local-memory stores (STL) counted in the
# SASS: register spills, or local arrays the code indexes at run time (read the SASS to tell which).
for cubin in "$out"/kernels/*.cubin; do
    "$nvdisasm" -c "$cubin" >"${cubin%.cubin}.sass"
    python3 - "$cubin" "${cubin%.cubin}.sass" <<'PY'
import re, struct, sys
data = open(sys.argv[1], "rb").read()
shoff = struct.unpack_from("<Q", data, 0x28)[0]
shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
def cstr(off):
    return data[off:data.index(b"\0", off)].decode()
names = [cstr(secs[shstrndx][4] + s[0]) for s in secs]
sec = dict(zip(names, secs))
symtab, strtab = sec[".symtab"], sec[".strtab"]
syms = [cstr(strtab[4] + struct.unpack_from("<I", data, symtab[4] + 24 * i)[0]) for i in range(symtab[5] // 24)]
regs = {}
info = sec[".nv.info"]
o, end = info[4], info[4] + info[5]
while o < end:
    fmt, attr, size = struct.unpack_from("<BBH", data, o)
    if fmt == 4:  # EIFMT_SVAL: attribute with a payload
        if attr == 0x2F:  # EIATTR_REGCOUNT: (symbol index, registers)
            si, n = struct.unpack_from("<II", data, o + 4)
            regs[syms[si]] = n
        o += 4 + size
    else:
        o += 4
spills, cur = {}, None
for line in open(sys.argv[2]):
    m = re.match(r"^\.text\.(\S+):", line)
    if m:
        cur = m.group(1)
        spills[cur] = 0
    elif cur and re.search(r"\bSTL(\.|\s)", line):
        spills[cur] += 1
module = sys.argv[1].rsplit("/", 1)[-1].split("-")[0]
for k in sorted(regs):
    print(f"{module:8} {k:32} {regs[k]:4} registers  {spills.get(k, 0):3} local stores (STL)")
PY
done
for k in "$@"; do
    f=$(grep -l "^\.text\.$k:" "$out"/kernels/*.sass | head -1) || { echo "no entry point $k" >&2; exit 1; }
    awk -v k=".text.$k:" '$0 == k {on = 1; print; next} /^\.text\./ {on = 0} on' "$f" >"$out/$k.sass"
    echo "$k: $(grep -c ';' "$out/$k.sass") instructions in $out/$k.sass"
done
