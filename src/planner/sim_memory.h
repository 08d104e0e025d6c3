#pragma once
// The replay's count of FSDP's transient memory (schedule_sim.cpp): parameters, gradients and
// activations over their resting state, their peaks, and what the buffer pool keeps once warm.
#include <algorithm>
#include <cstdint>
#include <map>

namespace fsdp::planner {

class SimMemory {
 public:
  // The transient peaks by kind and together, in bytes, and the bytes the warm pool keeps.
  struct Peaks {
    int64_t param = 0;
    int64_t grad = 0;
    int64_t activation = 0;
    int64_t total = 0;
    int64_t pool = 0;
  };

  // A parameter buffer of `bytes` taken from (n = 1) or given back to (n = -1) the pool.
  void param_buffer(int64_t bytes, int n) {
    add(params_, n * bytes, peaks_.param);
    pool(bytes, n);
  }
  // A gradient buffer of `bytes` taken from (n = 1) or given back to (n = -1) the pool.
  void grad_buffer(int64_t bytes, int n) {
    add(grads_, n * bytes, peaks_.grad);
    pool(bytes, n);
  }
  // Activations kept (b > 0) or freed (b < 0).
  void add_acts(int64_t b) { add(acts_, b, peaks_.activation); }
  // The peaks so far and the pool's bytes.
  Peaks peaks() const {
    Peaks p = peaks_;
    for (const auto& [bytes, count] : pool_) p.pool += bytes * count.most;
    return p;
  }

 private:
  struct Count {
    int live = 0;
    int most = 0;
  };
  void add(int64_t& kind, int64_t b, int64_t& peak) {
    kind += b;
    peak = std::max(peak, kind);
    peaks_.total = std::max(peaks_.total, params_ + grads_ + acts_);
  }
  void pool(int64_t bytes, int n) {
    if (bytes <= 0) return;
    Count& c = pool_[bytes];
    c.live += n;
    c.most = std::max(c.most, c.live);
  }

  int64_t params_ = 0, grads_ = 0, acts_ = 0;
  Peaks peaks_;
  std::map<int64_t, Count> pool_;
};

}  // namespace fsdp::planner
