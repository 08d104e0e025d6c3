#pragma once
// Counts live CPU tensor bytes (and their peak) by wrapping LibTorch's CPU allocator.
// Install it before any tensor exists: c10::SetCPUAllocator(new CountingAllocator(c10::GetCPUAllocator()), 100).
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace fsdp_bench {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner), inner_deleter_(inner->raw_deleter()) {
    TORCH_CHECK(inner_deleter_ != nullptr, "the CPU allocator has no raw deleter to wrap");
    instance_ = this;
  }

  // LibTorch 2.3 made allocate() non-const and added copy_data() (for Allocator::clone).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(size_t bytes) override {
#else
  c10::DataPtr allocate(size_t bytes) const override {
#endif
    c10::DataPtr inner = inner_->allocate(bytes);
    void* data = inner.get();
    TORCH_CHECK(inner.get_context() == data && inner.get_deleter() == inner_deleter_,
                "unexpected CPU allocation layout");
    inner.release_context();
    {
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[data] = bytes;
      live_ += static_cast<int64_t>(bytes);
      peak_ = std::max(peak_, live_);
    }
    return {data, data, &CountingAllocator::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#endif

  int64_t live() const {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }
  int64_t peak() const {
    std::lock_guard<std::mutex> lock(mu_);
    return peak_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_ = live_;
  }

 private:
  static void release(void* data) {
    CountingAllocator* self = instance_;
    if (data == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      auto it = self->sizes_.find(data);
      if (it != self->sizes_.end()) {
        self->live_ -= static_cast<int64_t>(it->second);
        self->sizes_.erase(it);
      }
    }
    self->inner_deleter_(data);
  }

  static inline CountingAllocator* instance_ = nullptr;
  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_deleter_;
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, size_t> sizes_;
  mutable int64_t live_ = 0, peak_ = 0;
};

}  // namespace fsdp_bench
