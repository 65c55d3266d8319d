"""Shrink a libnccl.so.2 to the code of one GPU architecture, so that a newer NCCL than the one a
GPU machine has can be carried to it (PyPI's nvidia-nccl-cu13 2.32.3 holds a 344 MB library).

    python tools/slim_nccl.py nvidia/nccl/lib/libnccl.so.2 libnccl.so.2 --arch 90
    strip --strip-debug libnccl.so.2 && xz -T0 libnccl.so.2       # about 34 MB

The library's device code sits in two ELF sections, `.nv_fatbin` (what the CUDA runtime loads)
and `__nv_relfatbin` (relocatable copies for device linking). Both are sequences of fatbins: a
16-byte header (magic 0xBA55ED50, version, header size, payload size) followed by entries, each
with its own header (kind: 1 PTX, 2 ELF; header size; payload size; the architecture at byte 28).
Entries of other architectures keep their headers and get zeroed payloads, so nothing moves in
the file and the runtime still finds the entry for the GPU's architecture; the zeros compress
away. Only for transfers to a machine with that one architecture: elsewhere the library fails
to load its kernels.
"""

import argparse
import struct
import sys
from typing import Dict, Tuple

FATBIN_MAGIC = 0xBA55ED50
SECTIONS = (".nv_fatbin", "__nv_relfatbin")


def elf_sections(data: bytes) -> Dict[str, Tuple[int, int]]:
    """Name -> (file offset, size) of every section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i: int) -> tuple:
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names_at = header(shstrndx)[4]
    out = {}
    for i in range(shnum):
        h = header(i)
        start = names_at + h[0]
        out[data[start : data.index(0, start)].decode()] = (h[4], h[5])
    return out


def blank_other_archs(data: bytearray, offset: int, size: int, keep: int) -> Tuple[int, int]:
    """Zero the payload of every fatbin entry in data[offset:offset+size] whose architecture is
    not `keep`; returns (bytes kept, bytes zeroed)."""
    kept = zeroed = 0
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # padding between fatbins
            pos += 8
            continue
        entry, fat_end = pos + header_size, pos + header_size + fat_size
        while entry < fat_end:
            _kind, _flags, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            (arch,) = struct.unpack_from("<I", data, entry + 28)
            body = entry + entry_header
            if arch == keep:
                kept += payload
            else:
                data[body : body + payload] = bytes(payload)
                zeroed += payload
            entry = body + payload
        pos = fat_end
    return kept, zeroed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="libnccl.so.2 to read")
    ap.add_argument("dst", help="where to write the shrunk copy")
    ap.add_argument("--arch", type=int, default=90, help="SM architecture to keep, e.g. 90 for H100/H200 (default)")
    args = ap.parse_args(argv)
    with open(args.src, "rb") as f:
        data = bytearray(f.read())
    sections = elf_sections(bytes(data))
    if not any(name in sections for name in SECTIONS):
        print(f"{args.src}: no {' or '.join(SECTIONS)} section", file=sys.stderr)
        return 1
    for name in SECTIONS:
        if name in sections:
            kept, zeroed = blank_other_archs(data, *sections[name], keep=args.arch)
            print(f"{name}: kept {kept / 2**20:.1f} MiB of sm_{args.arch}, zeroed {zeroed / 2**20:.1f} MiB")
    with open(args.dst, "wb") as f:
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
