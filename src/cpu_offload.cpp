#include "cpu_offload.h"

#ifdef FSDP_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <deque>
#include <mutex>
#endif

#include "fsdp/check.h"
#include "internal_op_guard.h"

namespace fsdp {

#ifdef FSDP_WITH_CUDA

namespace {

// A copy between host and device: its tensors, and the event recorded after it.
class CopyWork : public Work {
 public:
  CopyWork(c10::Device device, bool to_host, at::Tensor dst, at::Tensor src)
      : device_(device), to_host_(to_host), dst_(std::move(dst)), src_(std::move(src)) {}
  ~CopyWork() override {
    // A copy to the host dropped without wait(): its device source dies with it, so let the copy
    // finish first. (A copy to the device is ordered by the streams that use its destination.)
    if (to_host_ && !waited_ && done_.isCreated()) done_.synchronize();
  }
  void wait() override {
    if (to_host_) {
      done_.synchronize();
    } else {
      c10::cuda::CUDAGuard guard(device_);
      done_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    }
    waited_ = true;
  }
  bool completed() const override { return done_.query(); }
  at::cuda::CUDAEvent& done() { return done_; }
  void release_source() {
    if (!src_.defined()) return;
    c10::cuda::CUDAGuard guard(device_);
    done_.block(c10::cuda::getCurrentCUDAStream(device_.index()));
    src_ = at::Tensor();
  }

 private:
  c10::Device device_;
  bool to_host_;
  at::Tensor dst_, src_;
  at::cuda::CUDAEvent done_;
  bool waited_ = false;
};

// Page-locked host memory of exactly the size asked for.
void* pinned_alloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  FSDP_CHECK(e == cudaSuccess && p != nullptr, "CPU offload: could not allocate ", bytes,
             " bytes of page-locked host memory (", cudaGetErrorString(e),
             "); the host holds every shard, gradient and optimizer state under offload: use more "
             "ranks or hosts, or CpuOffload().pin_memory(false)");
  return p;
}
void pinned_free(void* p, size_t) { cudaFreeHost(p); }

}  // namespace

// Host casts whose copies may still read their staging tensors (at most this many, oldest first).
constexpr size_t kStagedInFlight = 3;

struct CpuOffloader::Streams {
  explicit Streams(c10::DeviceIndex index)
      : to_device(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)),
        to_host(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index)) {}
  c10::cuda::CUDAStream to_device, to_host;
  at::cuda::CUDAEvent ready;  // re-recorded on the caller's stream before each copy
  std::mutex staged_mutex;
  std::deque<WorkPtr> staged;  // copies from host-cast staging tensors, in issue order
};

CpuOffloader::CpuOffloader(c10::Device device, bool pin_memory)
    : device_(device),
      host_pool_(true, pin_memory ? BufferPool::HostMemory{pinned_alloc, pinned_free} : BufferPool::HostMemory{}) {
  FSDP_CHECK(device.is_cuda() && device.has_index(), "internal: CpuOffloader needs a CUDA device with an index");
  streams_ = std::make_unique<Streams>(device.index());
}

CpuOffloader::~CpuOffloader() {
  // The staging tensors go back to the pool only once no copy reads them.
  if (streams_) {
    for (const WorkPtr& w : streams_->staged) static_cast<CopyWork*>(w.get())->done().synchronize();
  }
}

at::Tensor CpuOffloader::host_empty(int64_t numel, at::ScalarType dtype) const {
  return host_pool_.empty(numel, at::TensorOptions().dtype(dtype));
}

WorkPtr CpuOffloader::to_device(at::Tensor dst, at::Tensor src, bool cast_on_host) {
  FSDP_CHECK(dst.device() == device_ && src.is_cpu() && dst.numel() == src.numel() && dst.is_contiguous() &&
                 src.is_contiguous(),
             "internal: CpuOffloader::to_device arguments");
  if (!cast_on_host || dst.scalar_type() == src.scalar_type())
    return copy(/*to_host=*/false, std::move(dst), std::move(src));
  // Note [Cast on the host]: the host casts into page-locked staging, the copy moves dst's bytes.
  at::Tensor staged = staging(src.numel(), dst.scalar_type());
  {
    InternalOpGuard internal;
    staged.copy_(src.view({-1}));
  }
  WorkPtr work = copy(/*to_host=*/false, std::move(dst), staged);
  std::lock_guard<std::mutex> lock(streams_->staged_mutex);
  streams_->staged.push_back(work);  // holds the staging tensor until its copy is done
  return work;
}

at::Tensor CpuOffloader::staging(int64_t numel, at::ScalarType dtype) {
  {
    std::lock_guard<std::mutex> lock(streams_->staged_mutex);
    auto& staged = streams_->staged;
    while (!staged.empty() && (staged.front()->completed() || staged.size() >= kStagedInFlight)) {
      static_cast<CopyWork*>(staged.front().get())->done().synchronize();  // at once when completed
      staged.pop_front();
    }
  }
  return host_empty(numel, dtype);
}

void CpuOffloader::on_copy_stream(const std::function<void()>& fn) {
  c10::cuda::CUDAGuard guard(device_);
  c10::cuda::CUDAStreamGuard on(streams_->to_device);
  fn();
}

WorkPtr CpuOffloader::to_host(at::Tensor dst, at::Tensor src) {
  FSDP_CHECK(src.device() == device_ && dst.is_cpu() && dst.numel() == src.numel() &&
                 dst.scalar_type() == src.scalar_type() && dst.is_contiguous() && src.is_contiguous(),
             "internal: CpuOffloader::to_host arguments");
  return copy(/*to_host=*/true, std::move(dst), std::move(src));
}

WorkPtr CpuOffloader::copy(bool to_host, at::Tensor dst, at::Tensor src) {
  c10::cuda::CUDAGuard guard(device_);
  InternalOpGuard internal;  // the runtime's own copies, not the model's parameter reads
  const c10::cuda::CUDAStream stream = to_host ? streams_->to_host : streams_->to_device;
  streams_->ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  streams_->ready.block(stream);
  auto work = std::make_shared<CopyWork>(device_, to_host, dst, src);
  {
    c10::cuda::CUDAStreamGuard on(stream);
    if (dst.scalar_type() == src.scalar_type()) {
      dst.view({-1}).copy_(src.view({-1}), /*non_blocking=*/true);
    } else {
      // To the device with a cast: through a staging tensor of the source's dtype, allocated on
      // (and so only reused in order by) the copy stream; the cast runs there too.
      at::Tensor staged = at::empty({src.numel()}, src.options().device(device_).pinned_memory(false));
      staged.copy_(src.view({-1}), /*non_blocking=*/true);
      dst.view({-1}).copy_(staged);
    }
  }
  work->done().record(stream);
  return work;
}

void CpuOffloader::release_source(const WorkPtr& copy_to_host) {
  if (auto* copy = dynamic_cast<CopyWork*>(copy_to_host.get())) copy->release_source();
}

#else  // no CUDA: a process group's device is always the CPU, where offload means nothing

struct CpuOffloader::Streams {};

CpuOffloader::CpuOffloader(c10::Device device, bool) : device_(device) {
  FSDP_FAIL("Options::offload needs a CUDA build of libfsdp and a process group on a CUDA device (got ", device,
            "); remove .offload(...)");
}
CpuOffloader::~CpuOffloader() = default;
at::Tensor CpuOffloader::host_empty(int64_t, at::ScalarType) const { FSDP_FAIL("internal: no CUDA"); }
WorkPtr CpuOffloader::to_device(at::Tensor, at::Tensor, bool) { FSDP_FAIL("internal: no CUDA"); }
at::Tensor CpuOffloader::staging(int64_t, at::ScalarType) { FSDP_FAIL("internal: no CUDA"); }
void CpuOffloader::on_copy_stream(const std::function<void()>&) { FSDP_FAIL("internal: no CUDA"); }
WorkPtr CpuOffloader::to_host(at::Tensor, at::Tensor) { FSDP_FAIL("internal: no CUDA"); }
WorkPtr CpuOffloader::copy(bool, at::Tensor, at::Tensor) { FSDP_FAIL("internal: no CUDA"); }
void CpuOffloader::release_source(const WorkPtr&) { FSDP_FAIL("internal: no CUDA"); }

#endif

}  // namespace fsdp
