#!/bin/bash
# Describes the GPU machine's toolchain and packs the headers a CPU machine needs to compile-check
# libfsdp's CUDA build against it (PyTorch's LibTorch, CUDA runtime, NCCL).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 - <<'PY'
import torch, os, sys
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
print("cxx11abi", torch._C._GLIBCXX_USE_CXX11_ABI)
print("cmake_prefix", torch.utils.cmake_prefix_path)
inc = os.path.join(os.path.dirname(torch.__file__), "include")
print("include", inc, sorted(os.listdir(inc)))
print("lib", sorted(os.listdir(os.path.join(os.path.dirname(torch.__file__), "lib"))))
import importlib.util
for m in ["nvidia.nccl", "nvidia.cuda_runtime", "nvidia.cu13"]:
    s = importlib.util.find_spec(m)
    print(m, s.submodule_search_locations if s else None)
PY
gcc --version | head -1; cmake --version | head -1; ninja --version; nvcc --version | tail -2
ls /usr/local/cuda/include | head -5; ls -d /usr/local/cuda* 
find / -name nccl.h -not -path '*/proc/*' 2>/dev/null | head
find / -name 'libnccl.so*' -not -path '*/proc/*' 2>/dev/null | head
ls /usr/include | grep -i -E "gtest|CLI|nlohmann|fmt|gloo" 
cat /etc/os-release | head -2; nproc; free -g | head -2
} > "$OUT/env.txt" 2>&1
TI=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"include"))')
NCCLH=$(dirname "$(find / -name nccl.h -not -path '*/proc/*' 2>/dev/null | head -1)")
CUDAI=$(dirname "$(find / -name cuda_runtime_api.h -not -path '*/proc/*' 2>/dev/null | head -1)")
echo "torch_inc=$TI nccl_inc=$NCCLH cuda_inc=$CUDAI" >> "$OUT/env.txt"
mkdir -p /tmp/h/torch /tmp/h/nccl /tmp/h/cuda
cp -r "$TI"/. /tmp/h/torch/; cp "$NCCLH"/nccl*.h /tmp/h/nccl/; cp -r "$CUDAI"/. /tmp/h/cuda/
du -sh /tmp/h/* >> "$OUT/env.txt"
tar -C /tmp/h -cf - . | xz -T16 -6 | split -b 15m - "$OUT/headers.tar.xz."
ls -la "$OUT" >> "$OUT/env.txt"
cat "$OUT/env.txt"
