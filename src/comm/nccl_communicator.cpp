#include "comm/nccl_communicator.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "fsdp/check.h"

namespace fsdp {
namespace {

#define FSDP_CUDA_CHECK(expr, what)                                                   \
  do {                                                                                \
    const cudaError_t err_ = (expr);                                                  \
    FSDP_CHECK(err_ == cudaSuccess, what, ": CUDA error ", cudaGetErrorString(err_)); \
  } while (0)

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte:
    case at::kBool: return ncclUint8;
    case at::kChar: return ncclInt8;
    default:
      FSDP_FAIL("NCCL communicator: dtype ", t,
                " is not supported (float, double, half, bfloat16 and "
                "integer types are)");
  }
}

// One NCCL communicator and the stream its collectives run on.
struct Lane {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  // Re-recorded on the caller's stream before each collective; cudaStreamWaitEvent takes the
  // record current at the call, so one event per lane serves every collective.
  cudaEvent_t ready = nullptr;
  std::string name;
};

class NcclWork;

struct Shared {
  std::string name;
  std::chrono::milliseconds timeout;
  c10::Device device;
  Lane lanes[2];
  std::mutex mu;
  std::string error;  // set once: the first failure; every later call reports it
  std::deque<std::weak_ptr<NcclWork>> in_flight;
  std::condition_variable cv;
  bool stopping = false;
  std::thread watchdog;

  Shared(std::string n, std::chrono::milliseconds t, c10::Device d) : name(std::move(n)), timeout(t), device(d) {}
  void check_ok() {
    std::lock_guard<std::mutex> lock(mu);
    FSDP_CHECK(error.empty(), error);
  }
  void fail(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!error.empty()) return;
      error = why;
    }
    for (auto& l : lanes)
      if (l.comm) ncclCommAbort(l.comm), l.comm = nullptr;
  }
};

class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<Shared> shared, std::vector<at::Tensor> keep, std::string what)
      : shared_(std::move(shared)),
        keep_(std::move(keep)),
        what_(std::move(what)),
        issued_(std::chrono::steady_clock::now()) {
    FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "creating a CUDA event");
  }
  ~NcclWork() override {
    // Dropped without wait(): the buffers die with this handle, so the CPU waits for the kernel
    // rather than let the allocator reuse memory NCCL may still write.
    if (!waited_ && recorded_) cudaEventSynchronize(done_);
    cudaEventDestroy(done_);
  }
  void record(cudaStream_t s) {
    FSDP_CUDA_CHECK(cudaEventRecord(done_, s), "recording a CUDA event");
    recorded_ = true;
  }
  cudaEvent_t event() const { return done_; }
  void wait() override {
    shared_->check_ok();
    c10::cuda::CUDAGuard guard(shared_->device);
    FSDP_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(shared_->device.index()).stream(), done_, 0),
                    "waiting for " + what_);
    waited_ = true;
  }
  bool completed() const override { return cudaEventQuery(done_) == cudaSuccess; }
  std::chrono::steady_clock::time_point issued() const { return issued_; }
  const std::string& what() const { return what_; }

 private:
  std::shared_ptr<Shared> shared_;
  std::vector<at::Tensor> keep_;
  std::string what_;
  std::chrono::steady_clock::time_point issued_;
  cudaEvent_t done_ = nullptr;
  bool recorded_ = false;
  bool waited_ = false;
};

void check_nccl(std::shared_ptr<Shared>& sh, ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess) return;
  std::string msg =
      sh->name + ": NCCL " + what + " failed: " + ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")";
  sh->fail(msg);
  FSDP_FAIL(msg);
}

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Shared> sh, int rank, int size) : sh_(std::move(sh)), rank_(rank), size_(size) {
    sh_->watchdog = std::thread([s = sh_.get()] { watch(s); });
  }
  ~NcclCommunicator() override {
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      sh_->stopping = true;
    }
    sh_->cv.notify_all();
    sh_->watchdog.join();
    c10::cuda::CUDAGuard guard(sh_->device);
    for (auto& l : sh_->lanes) {
      if (l.stream) cudaStreamSynchronize(l.stream);
      if (l.comm) ncclCommDestroy(l.comm), l.comm = nullptr;
      if (l.stream) cudaStreamDestroy(l.stream), l.stream = nullptr;
      if (l.ready) cudaEventDestroy(l.ready), l.ready = nullptr;
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return sh_->name; }
  c10::Device device() const override { return sh_->device; }
  std::string transport() const override { return "NCCL"; }

  WorkPtr all_gather_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_args(out, "all_gather_into output");
    check_args(in, "all_gather_into input");
    FSDP_CHECK(out.numel() == in.numel() * size_ && out.scalar_type() == in.scalar_type(), sh_->name,
               ": all_gather_into needs an output of size() * input elements of the input's dtype (got ", out.numel(),
               " ", out.scalar_type(), " for ", in.numel(), " ", in.scalar_type(), ")");
    return launch(0, {out, in}, "all-gather", opts, [&](Lane& l) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), nccl_type(in.scalar_type()), l.comm, l.stream);
    });
  }
  WorkPtr reduce_scatter(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_args(out, "reduce_scatter output");
    check_args(in, "reduce_scatter input");
    FSDP_CHECK(in.numel() == out.numel() * size_ && out.scalar_type() == in.scalar_type(), sh_->name,
               ": reduce_scatter needs an input of size() * output elements of the output's dtype (got ", in.numel(),
               " ", in.scalar_type(), " for ", out.numel(), " ", out.scalar_type(), ")");
    return launch(1, {out, in}, "reduce-scatter", opts, [&](Lane& l) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), nccl_type(in.scalar_type()), ncclSum, l.comm,
                               l.stream);
    });
  }
  WorkPtr all_reduce(at::Tensor t, CollectiveOptions opts) override {
    check_args(t, "all_reduce tensor");
    return launch(1, {t}, "all-reduce", opts, [&](Lane& l) {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), ncclSum, l.comm,
                           l.stream);
    });
  }
  bool has_all_to_all() const override { return true; }
  // NCCL has no all-to-all: one grouped send and receive per peer, on the reduce lane (the
  // quantized gradient reductions use it).
  WorkPtr all_to_all_into(at::Tensor out, at::Tensor in, CollectiveOptions opts) override {
    check_args(out, "all_to_all_into output");
    check_args(in, "all_to_all_into input");
    FSDP_CHECK(out.numel() == in.numel() && out.scalar_type() == in.scalar_type() && in.numel() % size_ == 0, sh_->name,
               ": all_to_all_into needs an output and an input of the same dtype and numel, a multiple of ", size_,
               " (got ", out.numel(), " ", out.scalar_type(), " and ", in.numel(), " ", in.scalar_type(), ")");
    return launch(1, {out, in}, "all-to-all", opts, [&](Lane& l) {
      const auto part = static_cast<size_t>(in.numel() / size_);
      const size_t part_bytes = part * static_cast<size_t>(in.element_size());
      const ncclDataType_t type = nccl_type(in.scalar_type());
      const auto* send = static_cast<const char*>(in.data_ptr());
      auto* recv = static_cast<char*>(out.data_ptr());
      ncclResult_t r = ncclGroupStart();
      for (int p = 0; p < size_ && r == ncclSuccess; ++p) {
        r = ncclSend(send + static_cast<size_t>(p) * part_bytes, part, type, p, l.comm, l.stream);
        if (r == ncclSuccess) r = ncclRecv(recv + static_cast<size_t>(p) * part_bytes, part, type, p, l.comm, l.stream);
      }
      const ncclResult_t end = ncclGroupEnd();
      return r == ncclSuccess ? end : r;
    });
  }
  WorkPtr broadcast(at::Tensor t, int root, CollectiveOptions opts) override {
    check_args(t, "broadcast tensor");
    FSDP_CHECK(root >= 0 && root < size_, sh_->name, ": broadcast root ", root, " is outside [0, ", size_, ")");
    return launch(0, {t}, "broadcast", opts, [&](Lane& l) {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), t.numel(), nccl_type(t.scalar_type()), root, l.comm, l.stream);
    });
  }
  void barrier() override {
    c10::cuda::CUDAGuard guard(sh_->device);
    at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kFloat).device(sh_->device));
    all_reduce(one, CollectiveOptions{})->wait();
    (void)one.item<float>();  // synchronizes the current stream, which waited for the all-reduce
  }

 private:
  void check_args(const at::Tensor& t, const char* what) const {
    FSDP_CHECK(t.defined() && t.device() == sh_->device && t.is_contiguous(), sh_->name, ": the ", what,
               " must be a contiguous tensor on ", sh_->device, " (got ",
               t.defined() ? t.device().str() : std::string("an undefined tensor"), ")");
  }

  template <typename Launch>
  WorkPtr launch(int lane_index, std::vector<at::Tensor> keep, const char* what, const CollectiveOptions& opts,
                 Launch&& fn) {
    sh_->check_ok();
    c10::cuda::CUDAGuard guard(sh_->device);
    Lane& lane = sh_->lanes[lane_index];
    const cudaStream_t current = c10::cuda::getCurrentCUDAStream(sh_->device.index()).stream();
    auto work = std::make_shared<NcclWork>(sh_, std::move(keep), std::string(what) + " on " + sh_->name);
    auto* prior = dynamic_cast<NcclWork*>(opts.after.get());
    // Other work (another transport's, or one that queues kernels on the caller's stream once its
    // own collective is done, as a quantized reduction's stages do): waited for first, so the ready
    // event below follows whatever it queued.
    if (opts.after && !prior) opts.after->wait();
    // The lane waits for the caller's stream: inputs written and the output's memory free there.
    FSDP_CUDA_CHECK(cudaEventRecord(lane.ready, current), "recording a CUDA event");
    FSDP_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, lane.ready, 0), "ordering a collective after its inputs");
    if (prior) FSDP_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, prior->event(), 0), "chaining a collective");
    check_nccl(sh_, fn(lane), what);
    work->record(lane.stream);
    {
      std::lock_guard<std::mutex> lock(sh_->mu);
      sh_->in_flight.push_back(work);
    }
    sh_->cv.notify_all();
    return work;
  }

  // Fails the communicator when a collective has not completed within the timeout, or NCCL
  // reports an asynchronous error (a peer died).
  static void watch(Shared* s) {
    std::unique_lock<std::mutex> lock(s->mu);
    while (!s->stopping) {
      s->cv.wait_for(lock, std::chrono::milliseconds(100));
      while (!s->in_flight.empty()) {
        auto w = s->in_flight.front().lock();
        if (!w || w->completed()) {
          s->in_flight.pop_front();
          continue;
        }
        if (std::chrono::steady_clock::now() - w->issued() > s->timeout) {
          const std::string why = s->name + ": " + w->what() + " did not complete within " +
                                  std::to_string(s->timeout.count() / 1000) +
                                  " s; a peer rank died, hangs, or "
                                  "issued different collectives (every rank must run the same model and steps). "
                                  "Set FSDP_TIMEOUT_S to wait longer";
          lock.unlock();
          s->fail(why);
          lock.lock();
        }
        break;
      }
      if (!s->error.empty()) continue;
      for (auto& l : s->lanes) {
        ncclResult_t async = ncclSuccess;
        if (l.comm && ncclCommGetAsyncError(l.comm, &async) == ncclSuccess && async != ncclSuccess &&
            async != ncclInProgress) {
          const std::string why = s->name + ": NCCL reported an asynchronous error (" +
                                  std::string(ncclGetErrorString(async)) + "); a peer rank likely died";
          lock.unlock();
          s->fail(why);
          lock.lock();
          break;
        }
      }
    }
  }

  std::shared_ptr<Shared> sh_;
  int rank_, size_;
};

}  // namespace

CommunicatorPtr make_nccl_communicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                       std::string name, std::chrono::milliseconds timeout, c10::Device device) {
  FSDP_CHECK(device.is_cuda() && device.has_index(), name, ": NCCL needs a CUDA device with an index (got ", device,
             ")");
  int count = 0;
  FSDP_CUDA_CHECK(cudaGetDeviceCount(&count), "counting CUDA devices");
  FSDP_CHECK(device.index() < count, "rank ", rank, " of ", name, " asked for ", device, " but this host has ", count,
             " CUDA device(s); give each rank of a host its own device (e.g. cuda:LOCAL_RANK)");
  auto sh = std::make_shared<Shared>(name, timeout, device);
  c10::cuda::CUDAGuard guard(device);
  for (int i = 0; i < 2; ++i) {
    Lane& l = sh->lanes[i];
    l.name = i == 0 ? "gather" : "reduce";
    ncclUniqueId id;
    const std::string key = "nccl_id_" + l.name;
    if (rank == 0) {
      check_nccl(sh, ncclGetUniqueId(&id), "ncclGetUniqueId");
      const auto* b = reinterpret_cast<const uint8_t*>(&id);
      store->set(key, std::vector<uint8_t>(b, b + sizeof(id)));
    } else {
      std::vector<uint8_t> bytes;
      try {
        store->wait({key}, timeout);
        bytes = store->get(key);
      } catch (const std::exception& e) {
        FSDP_FAIL("rank ", rank, " of ", name, " did not receive the NCCL id from rank 0 (", e.what(),
                  "); check that rank 0 is alive and built the same process group");
      }
      FSDP_CHECK(bytes.size() == sizeof(id), name, ": malformed NCCL id in the store");
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    int lowest = 0, highest = 0;
    FSDP_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest), "reading stream priorities");
    // Communication streams get the higher priority, as in PyTorch FSDP: their kernels are short
    // and everything else waits for them.
    FSDP_CUDA_CHECK(cudaStreamCreateWithPriority(&l.stream, cudaStreamNonBlocking, highest), "creating a CUDA stream");
    FSDP_CUDA_CHECK(cudaEventCreateWithFlags(&l.ready, cudaEventDisableTiming), "creating a CUDA event");
    check_nccl(sh, ncclCommInitRank(&l.comm, size, id, rank), "ncclCommInitRank (" + l.name + " lane)");
  }
  return std::make_shared<NcclCommunicator>(std::move(sh), rank, size);
}

}  // namespace fsdp
