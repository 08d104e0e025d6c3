#pragma once
// A cluster as the planner sees it (fsdp::plan, planner.h): one kind of device, ranks per node,
// the links within and between nodes, and the host behind each device. Presets, a compact spec
// ("a100-80g:64x8") and a JSON file; fields and presets: docs/planner.md.
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/network_model.h"

namespace fsdp {

struct DeviceSpec {
  std::string name;
  int64_t memory_bytes = 0;      // usable by one rank
  double peak_flops_fp32 = 0;    // dense FLOP/s, float32 operands
  double peak_flops_16 = 0;      // dense FLOP/s, bfloat16/float16 operands
  double memory_gbps = 0;        // device memory bandwidth, GB/s
  double matmul_efficiency = 1;  // share of peak a transformer's matrix products reach
};

struct Cluster {
  DeviceSpec device;
  int nodes = 1;
  int ranks_per_node = 1;
  Link intra;                     // between ranks of one node, per rank
  Link inter;                     // between nodes, per rank
  int64_t host_memory_bytes = 0;  // per node
  double host_device_gbps = 0;    // host <-> device copies (CPU offload), per rank
  // The device's memory is the host's (this CPU machine): offload moves nothing.
  bool device_is_host = false;
  // Gathers and reductions run on separate lanes (NCCL streams); else one FIFO per communicator.
  bool separate_comm_lanes = false;

  int world() const { return nodes * ranks_per_node; }
  // e.g. "a100-80g: 8 nodes x 8 ranks, 80 GiB, 312 TFLOP/s (16-bit), intra 300 GB/s, inter 25 GB/s"
  std::string describe() const;
  // The link groups of `n` consecutive ranks use: `intra` within a node; across nodes, the
  // spanning_link of the fewest ranks any such group has on one node (network_model.h).
  Link link_for_group(int n) const;

  // A preset by name (preset_names()), `nodes` x `ranks_per_node`. Throws fsdp::Error naming the
  // known presets.
  static Cluster preset(const std::string& name, int nodes, int ranks_per_node);
  static std::vector<std::string> preset_names();
  // "NAME", "NAME:NODESxRANKS" (e.g. "a100-80g:64x8", "cpu:1x4"), or the path of a JSON file
  // (from_file: a name ending in .json, holding a '/', or an existing file's); spaces around it are dropped.
  // Throws fsdp::Error.
  static Cluster parse(const std::string& spec);
  // A JSON object: {"preset": NAME, "nodes": N, "ranks_per_node": R, "device": {...}, "intra":
  // {"bandwidth_gbps", "latency_us"}, "inter": {...}, "host_memory_gib", "host_device_gbps"}; every
  // field optional over the preset (default "cpu"). Throws fsdp::Error naming the bad field.
  static Cluster from_file(const std::string& path);
  static Cluster from_json(const std::string& text, const std::string& source = "cluster JSON");
};

// "40GiB", "70 GB", "512MiB", "1.5TiB", "123456" (bytes), binary units to EiB and decimal to EB; whole
// numbers exact up to 2^63 - 1 bytes. Throws fsdp::Error.
int64_t parse_bytes(const std::string& text);
// e.g. "512 B", "3.25 KiB", "1.50 GiB": binary units, the largest that keeps the number at 1 or more.
std::string format_bytes(int64_t bytes);

}  // namespace fsdp
