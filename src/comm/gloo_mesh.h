#pragma once
// A Gloo full mesh whose every pair is proven to reach a rank of this job before it is used: a
// pair that a stranger's connection took during set-up fails the proof, and the members connect
// again on fresh ports (Note [Verified Gloo mesh] in docs/design.md).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

namespace gloo {
class Context;
}

namespace fsdp {

struct GlooMeshSettings {
  std::string iface;                                           // the interface Gloo binds to, if set
  std::string hostname;                                        // else the address it binds to
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // the group's collective timeout
  int attempts = 4;                                            // set-ups tried before giving up
};

// Connects member `my_index` of `size` to the others of group `id` through `store` (prefixed for
// this group). Throws fsdp::Error naming the group, the attempts and the last failure.
std::shared_ptr<gloo::Context> connect_verified_mesh(const c10::intrusive_ptr<c10d::Store>& store, int my_index,
                                                     int size, const std::string& id, const GlooMeshSettings& settings);

}  // namespace fsdp
