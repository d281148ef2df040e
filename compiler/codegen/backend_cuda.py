"""CUDA C++ kernels: rendered `.cu` source -> cubin with nvcc, no GPU needed.

`compile_cuda` is called by the build loop in a worker process (the loop caches by content hash).
`cubin_info` reads a cubin's ELF (target, kernels, parameter sizes) without any CUDA tool; the
TileLang backend and the tests use it too.
"""
import re
import shutil
import struct
import subprocess
from pathlib import Path

from infc import envs

NVCC = envs.value("INFC_NVCC") or shutil.which("nvcc") or "/usr/local/bin/nvcc"


class CudaCompileError(Exception):
    pass


def gencode(arch: str) -> list[str]:
    """sm_90 -> sm_90a: the Hopper kernels use sm_90a-only instructions (wgmma, setmaxnreg), and
    an sm_90a cubin loads on every sm_90 part (H100, H200). Other targets build as named."""
    m = re.fullmatch(r"sm_(\d+)(a?)", arch)
    if not m:
        raise CudaCompileError(f"unknown CUDA target '{arch}' (want sm_XY, e.g. sm_90)")
    num, suffix = m.group(1), m.group(2)
    if num == "90":
        suffix = "a"
    return [f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}"]


def nvcc_cubin(source: str, arch: str, workdir: Path, name: str = "kernel",
               extra: list[str] = (), std: str = "c++17") -> tuple[bytes, str]:
    """Compile one translation unit to a cubin; returns (cubin bytes, ptxas -v report)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src = workdir / f"{name}.cu"
    out = workdir / f"{name}.cubin"
    src.write_text(source)
    cmd = [NVCC, "-cubin", *gencode(arch), "-O3", f"-std={std}", "-Xptxas", "-v",
           *extra, "-o", str(out), str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise CudaCompileError(f"nvcc failed for {src} ({p.returncode}):\n{' '.join(cmd)}\n"
                               f"{p.stderr[-8000:]}")
    return out.read_bytes(), p.stderr


def parse_ptxas(report: str, entry: str) -> dict:
    """Registers, static shared memory and spills of `entry` from `-Xptxas -v` output."""
    info, current = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line) or \
            re.search(r"Function properties for (\S+)", line)
        if m:
            current = m.group(1)
            continue
        if current != entry:
            continue
        if m := re.search(r"Used (\d+) registers", line):
            info["num_regs"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            info["shared"] = int(sm.group(1)) if sm else 0
        if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            info["stack"], info["spill_stores"], info["spill_loads"] = map(int, m.groups())
    return info


def compile_cuda(source: str, meta: dict, arch: str, workdir: Path) -> tuple[bytes, dict]:
    """Build a rendered CUDA template into a cubin. Returns (cubin, metadata) where metadata is
    {"name": entry symbol, "shared": static smem bytes, "num_regs", "hidden_args": 0, "block",
     "dynamic_shared": META's dynamic smem bytes, "arch": the cubin's target}."""
    entry = meta["entry"]
    cubin, report = nvcc_cubin(source, arch, workdir, entry)
    info = cubin_info(cubin)
    if entry not in info["kernels"]:
        raise CudaCompileError(f"cubin has no kernel '{entry}' (has: {sorted(info['kernels'])}); "
                               f"is it declared extern \"C\" __global__?")
    check_params(meta, info["kernels"][entry], entry)
    ptx = parse_ptxas(report, entry)
    if ptx.get("spill_stores"):
        # Spills in a memory-bound kernel are a silent 2x: fail loud, fix the template or tuning.
        raise CudaCompileError(f"{entry}: ptxas spilled {ptx['spill_stores']} bytes:\n{report}")
    return cubin, {"name": entry, "shared": ptx.get("shared", 0), "num_regs": ptx.get("num_regs"),
                   "hidden_args": 0, "block": list(meta["block"]),
                   "dynamic_shared": meta.get("shared", 0), "arch": info["arch"]}


# ---- cubin (ELF) inspection -------------------------------------------------------------------

PARAM_BYTES = {"*": 8, "i32": 4, "u32": 4, "f32": 4, "i64": 8, "u64": 8, "f64": 8}
EIATTR_KPARAM_INFO = 0x17
EIATTR_CUDA_API_VERSION = 0x37


def param_bytes(ty: str) -> int:
    if ty.startswith("*"):
        return 8
    if ty.startswith("tensormap"):   # CUtensorMap, passed by value
        return 128
    return PARAM_BYTES[ty]


def check_params(meta: dict, params: list[int], entry: str):
    """META's parameters must be the kernel's, in order and size."""
    want = [param_bytes(ty) for _, ty, _ in meta["params"]]
    if want != params:
        names = [n for n, _, _ in meta["params"]]
        raise CudaCompileError(f"{entry}: META params {names} have sizes {want}, but the cubin's "
                               f"kernel takes parameters of sizes {params}")


def _sections(data: bytes):
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not a 64-bit ELF (cubin)")
    e_shoff, = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    strtab = hdrs[e_shstrndx]
    names = data[strtab[4]: strtab[4] + strtab[5]]

    def cstr(buf, off):
        return buf[off: buf.index(b"\0", off)].decode()

    return [(cstr(names, h[0]), h) for h in hdrs]


def _attributes(body: bytes):
    """(attribute, payload) of an .nv.info / .nv.compat section: 4-byte records (format, attribute,
    2 value bytes) except format 0x04, whose 2 bytes are the length of the payload that follows."""
    off = 0
    while off + 4 <= len(body):
        fmt, attr = body[off], body[off + 1]
        if fmt == 0x04:
            size, = struct.unpack_from("<H", body, off + 2)
            yield attr, body[off + 4: off + 4 + size]
            off += 4 + size
        else:
            yield attr, body[off + 2: off + 4]
            off += 4


def cubin_info(data: bytes) -> dict:
    """{"arch": "sm_90a", "kernels": {name: [param sizes in bytes, in order]}} from the ELF alone.

    The SM number is the ELF e_flags' bits 8..15 (cubin ABI 8, CUDA 12.8+ / 13; bits 0..7 in
    older ABIs). The arch-specific 'a' variant leaves e_flags alone: it is attribute 0x09 = 1
    of the .nv.compat section (the sm_90 and sm_90a builds of one kernel differ only there),
    which is what `cuobjdump --list-elf` reports as 'sm_90a'."""
    e_flags, = struct.unpack_from("<I", data, 0x30)
    sm = (e_flags >> 8) & 0xFF if data[8] >= 8 else e_flags & 0xFF
    sections = _sections(data)
    byname = {n: h for n, h in sections}
    kernels = {}
    for name, h in sections:
        if not name.startswith(".nv.info."):
            continue
        kname = name[len(".nv.info."):]
        params = {}
        for attr, payload in _attributes(data[h[4]: h[4] + h[5]]):
            if attr == EIATTR_KPARAM_INFO:
                _, ordinal, _offset, flags = struct.unpack_from("<IHHI", payload)
                params[ordinal] = (flags >> 18) & 0x3FFF
        if ".text." + kname in byname:
            kernels[kname] = [params[i] for i in sorted(params)]
    accel = False
    if ".nv.compat" in byname:
        h = byname[".nv.compat"]
        accel = any(attr == 0x09 and payload[:1] == b"\x01"
                    for attr, payload in _attributes(data[h[4]: h[4] + h[5]]))
    return {"arch": f"sm_{sm}{'a' if accel else ''}", "e_flags": e_flags, "kernels": kernels}
