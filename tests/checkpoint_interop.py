#!/usr/bin/env python3
"""libfsdp's safetensors files and Python, both ways, with plain Python (json, struct) and
torch.frombuffer as the safetensors format specifies (Debian bookworm has no python3-safetensors).

  checkpoint_interop.py PATH/TO/fsdp_tests

1. Two ranks of fsdp_tests train one step and export_full the model; this script parses the file
   (header rules included) and compares every tensor, and every tied name, with full_state_dict().
2. This script writes a safetensors file (F64, BF16 and F32 tensors) and two ranks load_full it;
   they compare with the values Python expects after conversion to float32.
Exit 0: pass, 1: fail, 77: skipped (python3-torch not installed).
"""
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("python3-torch is not installed; skipping")
    sys.exit(77)

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(binary, worker, args, world=2):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", FSDP_TIMEOUT_S="60")
        procs.append(subprocess.Popen([binary, "--fsdp-worker", worker] + args, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode != 0:
            sys.exit(f"FAIL: rank {rank} of {worker} exited {p.returncode}:\n{out}")
    return outputs


def read_safetensors(path):
    """Reads a safetensors file as the format's specification says, checking its rules."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    assert 8 + n <= len(data), "header longer than the file"
    assert n % 8 == 0, "header not padded to a multiple of 8 bytes"
    header = json.loads(data[8:8 + n].decode("utf-8"))
    body = data[8 + n:]
    metadata = header.pop("__metadata__", {})
    assert all(isinstance(v, str) for v in metadata.values()), "__metadata__ values must be strings"
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    end = 0
    for begin, stop, name in spans:  # contiguous, no gaps, no overlaps, as the Rust reader demands
        assert begin == end, f"{name}: data does not start where the previous tensor ended"
        end = stop
    assert end == len(body), "data section has bytes no tensor owns"
    tensors = {}
    for name, info in header.items():
        begin, stop = info["data_offsets"]
        raw = bytearray(body[begin:stop])
        t = torch.frombuffer(raw, dtype=DTYPES[info["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[info["dtype"]])
        tensors[name] = t.reshape(info["shape"])
    return tensors, metadata


def write_safetensors(path, tensors, metadata):
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        blob = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def tensor_of(ref):
    raw = bytearray.fromhex(ref["hex"])
    return torch.frombuffer(raw, dtype=torch.float32).reshape(ref["shape"]) if raw else torch.empty(ref["shape"])


def main():
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        exported, reference = os.path.join(tmp, "model.safetensors"), os.path.join(tmp, "reference.json")
        run_ranks(binary, "ckpt_interop_export", [exported, reference])
        tensors, metadata = read_safetensors(exported)
        with open(reference) as f:
            ref = json.load(f)
        aliases = json.loads(metadata.get("libfsdp.aliases", "{}"))
        assert aliases, "the model ties its embedding and head; the aliases must be in __metadata__"
        for name, value in ref.items():
            stored = aliases.get(name, name)
            assert stored in tensors, f"{name} is not in the export (nor an alias of a tensor in it)"
            got = tensors[stored]
            want = tensor_of(value)
            assert got.dtype == torch.float32 and list(got.shape) == value["shape"], f"{name}: dtype or shape"
            assert torch.equal(got, want), f"{name} differs from full_state_dict()"
        assert set(tensors) | set(aliases) == set(ref), "the export holds tensors the model does not have"
        print(f"read the export in Python: {len(tensors)} tensors, {len(aliases)} tied names, all equal")

        # Python -> C++: other dtypes, converted as Tensor.copy_ / .to() convert.
        written, expected = {}, {}
        for i, name in enumerate(sorted(tensors)):
            value = tensors[name].double() * 0.5 + 0.25
            stored = value if i % 3 == 0 else value.to(torch.bfloat16) if i % 3 == 1 else value.float()
            written[name] = stored
            as_model = stored.to(torch.float32)
            for n in [name] + [a for a, target in aliases.items() if target == name]:
                expected[n] = {"hex": as_model.contiguous().view(torch.uint8).numpy().tobytes().hex()}
        from_python = os.path.join(tmp, "from_python.safetensors")
        write_safetensors(from_python, written, {"format": "pt"})
        with open(os.path.join(tmp, "expected.json"), "w") as f:
            json.dump(expected, f)
        out = run_ranks(binary, "ckpt_interop_load", [from_python, os.path.join(tmp, "expected.json")])
        print(out[0].strip())
    print("PASS")


if __name__ == "__main__":
    main()
