#include "checkpoint/collective.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "fsdp/check.h"

namespace fsdp::checkpoint::detail {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.size();
  if (n == 1) return {mine};
  const auto dev = comm.device();
  at::Tensor len = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(dev);
  at::Tensor lens = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(dev));
  comm.all_gather_into(lens, len, CollectiveOptions::labeled("string all-gather: lengths"))->wait();
  lens = lens.cpu();
  int64_t longest = 0;
  for (int i = 0; i < n; ++i) longest = std::max(longest, lens[i].item<int64_t>());
  if (longest == 0) return std::vector<std::string>(n);
  at::Tensor in = at::zeros({longest}, at::kByte);
  std::memcpy(in.data_ptr(), mine.data(), mine.size());
  in = in.to(dev);
  at::Tensor out = at::empty({n * longest}, at::TensorOptions().dtype(at::kByte).device(dev));
  comm.all_gather_into(out, in, CollectiveOptions::labeled("string all-gather: bytes"))->wait();
  out = out.cpu();
  std::vector<std::string> all(n);
  for (int i = 0; i < n; ++i)
    all[i].assign(static_cast<const char*>(out.data_ptr()) + i * longest, static_cast<size_t>(lens[i].item<int64_t>()));
  return all;
}

void run_agreed(Communicator& comm, const std::string& what, const std::function<void()>& local) {
  std::string error;
  try {
    local();
  } catch (const std::exception& e) {
    error = e.what();
    if (error.empty()) error = "unknown error";
  }
  const auto errors = all_gather_strings(comm, error);
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    const std::string prefix = "libfsdp: ";
    std::string message = errors[r].rfind(prefix, 0) == 0 ? errors[r].substr(prefix.size()) : errors[r];
    if (comm.size() == 1) FSDP_FAIL(what, ": ", message);
    FSDP_FAIL(what, " failed on rank ", r, ": ", message);
  }
}

uint64_t shared_random(Communicator& comm) {
  std::random_device rd;
  const uint64_t mine = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                        static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  std::string bytes(sizeof(mine), '\0');
  std::memcpy(bytes.data(), &mine, sizeof(mine));
  const auto all = all_gather_strings(comm, bytes);
  uint64_t v = 0;
  std::memcpy(&v, all[0].data(), sizeof(v));
  return v;
}

std::string dtype_name(at::ScalarType type) {
  switch (type) {
    case at::kDouble: return "F64";
    case at::kFloat: return "F32";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kShort: return "I16";
    case at::kChar: return "I8";
    case at::kByte: return "U8";
    case at::kBool: return "BOOL";
    default: FSDP_FAIL("checkpoints do not store tensors of dtype ", type, "; convert the tensor to a supported dtype");
  }
}

at::ScalarType scalar_type_of(const std::string& name) {
  if (name == "F64") return at::kDouble;
  if (name == "F32") return at::kFloat;
  if (name == "F16") return at::kHalf;
  if (name == "BF16") return at::kBFloat16;
  if (name == "I64") return at::kLong;
  if (name == "I32") return at::kInt;
  if (name == "I16") return at::kShort;
  if (name == "I8") return at::kChar;
  if (name == "U8") return at::kByte;
  if (name == "BOOL") return at::kBool;
  FSDP_FAIL("unknown dtype name '", name, "'");
}

}  // namespace fsdp::checkpoint::detail
