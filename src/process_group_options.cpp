#include "fsdp/process_group_options.h"

#include "fsdp/check.h"

namespace fsdp {

Transport parse_transport(const std::string& name, const char* source) {
  if (name == "auto") return Transport::kAuto;
  if (name == "tcp") return Transport::kTcp;
  if (name == "shm") return Transport::kSharedMemory;
  FSDP_FAIL(source, "=", name,
            " is not a transport; use auto (shared memory within a host, TCP across hosts), "
            "tcp (Gloo over TCP) or shm (shared memory)");
}

const char* to_string(Transport transport) {
  switch (transport) {
    case Transport::kAuto: return "auto";
    case Transport::kTcp: return "tcp";
    case Transport::kSharedMemory: return "shm";
  }
  return "?";
}

}  // namespace fsdp
