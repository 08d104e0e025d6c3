#include "buffer_pool.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/alloc_cpu.h>
#include <sys/mman.h>

#include "fsdp/check.h"

namespace fsdp {
namespace {

// Below this a block comes from c10's CPU allocation (malloc); above it from mmap.
constexpr size_t kMapThreshold = size_t(256) << 10;

void* raw_alloc(size_t bytes) {
  if (bytes < kMapThreshold) return c10::alloc_cpu(bytes);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  FSDP_CHECK(p != MAP_FAILED, "out of memory: could not map ", bytes,
             " bytes for an FSDP buffer (unsharded parameters or gradients); shard more finely "
             "(a finer auto_wrap_policy), lower all_gather_limit, or use fewer ranks per host");
  return p;
}

void raw_free(void* p, size_t bytes) {
  if (bytes < kMapThreshold)
    c10::free_cpu(p);
  else
    ::munmap(p, bytes);
}

}  // namespace

struct BufferPool::State {
  mutable std::mutex mu;
  bool enabled = true;
  HostMemory memory{raw_alloc, raw_free};
  std::unordered_map<size_t, std::vector<void*>> idle;  // by exact size
  int64_t idle_bytes = 0;
  int64_t system_allocations = 0;

  void put(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (enabled) {
        idle[bytes].push_back(p);
        idle_bytes += static_cast<int64_t>(bytes);
        return;
      }
    }
    memory.free(p, bytes);
  }
  void* take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = idle.find(bytes);
    if (it == idle.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    idle_bytes -= static_cast<int64_t>(bytes);
    return p;
  }
  void clear() {
    std::unordered_map<size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mu);
      blocks.swap(idle);
      idle_bytes = 0;
    }
    for (auto& kv : blocks)
      for (void* p : kv.second) memory.free(p, kv.first);
  }
};

namespace {
// Deleter context: the block and a weak reference to the pool, which may be gone by the time the
// last tensor over the block dies (the block is then simply freed).
struct Block {
  void* ptr;
  size_t bytes;
  std::weak_ptr<BufferPool::State> pool;
  void (*free)(void*, size_t);
};
}  // namespace

BufferPool::BufferPool(bool enabled) : BufferPool(enabled, HostMemory{}) {}

BufferPool::BufferPool(bool enabled, HostMemory memory) : state_(std::make_shared<State>()) {
  state_->enabled = enabled;
  FSDP_CHECK((memory.alloc == nullptr) == (memory.free == nullptr),
             "internal: BufferPool::HostMemory needs both alloc and free, or neither");
  if (memory.alloc) state_->memory = memory;
}
BufferPool::~BufferPool() { state_->clear(); }

at::DataPtr BufferPool::allocate(size_t bytes, c10::Device device) {
  if (!device.is_cpu()) {
    c10::DeviceGuard guard(device);
    return c10::GetAllocator(device.type())->allocate(bytes);
  }
  const at::Device cpu(at::kCPU);
  if (bytes == 0) return at::DataPtr(nullptr, cpu);
  void* p = state_->take(bytes);
  if (!p) {
    p = state_->memory.alloc(bytes);
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->system_allocations;
  }
  auto* ctx = new Block{p, bytes, state_, state_->memory.free};
  return at::DataPtr(
      p, ctx,
      [](void* c) {
        std::unique_ptr<Block> block(static_cast<Block*>(c));
        if (auto pool = block->pool.lock())
          pool->put(block->ptr, block->bytes);
        else
          block->free(block->ptr, block->bytes);
      },
      cpu);
}

at::Tensor BufferPool::empty(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  auto storage = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), bytes,
                                                       allocate(bytes, options.device()),
                                                       /*allocator=*/nullptr, /*resizable=*/false);
  // Built directly, not by empty().set_(): one per FlatParameter per iteration (Note [Per-unit overhead]).
  auto impl = c10::make_intrusive<c10::TensorImpl>(at::Storage(std::move(storage)),
                                                   c10::DispatchKeySet(options.computeDispatchKey()), options.dtype());
  impl->set_sizes_contiguous({numel});
  return at::Tensor(std::move(impl));
}

void BufferPool::release_cached() { state_->clear(); }

int64_t BufferPool::cached_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->idle_bytes;
}

int64_t BufferPool::system_allocations() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->system_allocations;
}

bool BufferPool::enabled() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->enabled;
}

void BufferPool::set_enabled(bool on) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->enabled = on;
  }
  if (!on) state_->clear();
}

}  // namespace fsdp
