// The pool behind Options::reuse_buffers, and its effect in training.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <vector>

#include "buffer_pool.h"
#include "harness.h"
#include "models.h"

using namespace fsdp_test;

TEST(BufferPool, ReusesAReleasedBlockOfTheSameSizeOnly) {
  for (size_t bytes : {size_t(4096), size_t(3) << 20}) {  // below and above the mmap threshold
    fsdp::BufferPool pool;
    void* first = nullptr;
    {
      at::DataPtr p = pool.allocate(bytes);
      first = p.get();
      ASSERT_NE(first, nullptr);
      static_cast<char*>(first)[bytes - 1] = 7;  // writable to the end
      EXPECT_EQ(pool.cached_bytes(), 0);
    }
    EXPECT_EQ(pool.cached_bytes(), int64_t(bytes));
    at::DataPtr other = pool.allocate(bytes + 64);
    EXPECT_NE(other.get(), first);
    EXPECT_EQ(pool.cached_bytes(), int64_t(bytes));
    at::DataPtr again = pool.allocate(bytes);
    EXPECT_EQ(again.get(), first);
    EXPECT_EQ(pool.cached_bytes(), 0);
    EXPECT_EQ(pool.system_allocations(), 2);
  }
}

TEST(BufferPool, ATensorKeepsItsBlockUntilTheLastViewDies) {
  fsdp::BufferPool pool;
  at::Tensor view;
  {
    at::Tensor t = pool.empty(1 << 18, at::TensorOptions(at::kFloat));
    t.fill_(2);
    view = t.narrow(0, 10, 5);
  }
  EXPECT_EQ(pool.cached_bytes(), 0);
  EXPECT_EQ(view.sum().item<float>(), 10.f);
  view = at::Tensor();
  EXPECT_EQ(pool.cached_bytes(), int64_t(4) << 18);
  pool.release_cached();
  EXPECT_EQ(pool.cached_bytes(), 0);
}

TEST(BufferPool, DisabledFreesAtOnceAndBlocksMayOutliveThePool) {
  at::Tensor survivor;
  {
    fsdp::BufferPool pool(/*enabled=*/false);
    { at::DataPtr p = pool.allocate(1 << 20); }
    EXPECT_EQ(pool.cached_bytes(), 0);
    pool.set_enabled(true);
    survivor = pool.empty(1 << 20, at::TensorOptions(at::kDouble)).fill_(1.5);
  }
  EXPECT_EQ(survivor.sum().item<double>(), 1.5 * (1 << 20));  // freed, not cached, when it dies
}

// The memory a pool draws from can be replaced (CPU offload on a GPU passes page-locked memory):
// the backend sees exact sizes, is asked again only for a size with no idle block, and gets every
// block back, also one whose tensor outlives the pool.
namespace {
std::map<void*, size_t> g_backend_blocks;
std::vector<size_t> g_backend_sizes;
void* counting_alloc(size_t bytes) {
  void* p = std::malloc(bytes);
  g_backend_blocks[p] = bytes;
  g_backend_sizes.push_back(bytes);
  return p;
}
void counting_free(void* p, size_t bytes) {
  EXPECT_EQ(g_backend_blocks.at(p), bytes);
  g_backend_blocks.erase(p);
  std::free(p);
}
}  // namespace

TEST(BufferPool, HostMemoryBackendGetsExactSizesAndEveryBlockBack) {
  g_backend_blocks.clear();
  g_backend_sizes.clear();
  at::Tensor survivor;
  {
    fsdp::BufferPool pool(true, {counting_alloc, counting_free});
    const int64_t odd = (int64_t(1) << 20) + 3;  // not a power of two: kept as is
    { at::Tensor a = pool.empty(odd, at::TensorOptions(at::kFloat)).fill_(1); }
    at::Tensor b = pool.empty(odd, at::TensorOptions(at::kFloat)).fill_(2);  // the same block again
    at::Tensor c = pool.empty(100, at::TensorOptions(at::kDouble)).fill_(3);
    EXPECT_EQ(g_backend_sizes, (std::vector<size_t>{size_t(odd) * 4, 800}));
    EXPECT_EQ(pool.system_allocations(), 2);
    EXPECT_EQ(b.sum().item<double>(), 2.0 * double(odd));
    survivor = c;
  }
  EXPECT_EQ(g_backend_blocks.size(), 1u);  // the survivor's: returned when it dies
  EXPECT_EQ(survivor.sum().item<double>(), 300.0);
  survivor = at::Tensor();
  EXPECT_TRUE(g_backend_blocks.empty());
  EXPECT_THROW(fsdp::BufferPool(true, {counting_alloc, nullptr}), fsdp::Error);
}

// Trains with reuse on and off: the same parameters bit for bit; with reuse, no buffer is
// obtained from the system after the second iteration (the first has no recorded order yet, so
// it prefetches differently), and idle buffers show as cached.
FSDP_WORKER(buffer_reuse_worker) {
  auto pg = fsdp::ProcessGroup::from_env();
  std::vector<std::unordered_map<std::string, at::Tensor>> results;
  for (bool reuse : {true, false}) {
    torch::manual_seed(3);
    MLP model(6, 24, 3, 4);
    auto sharded = fsdp::fully_shard(
        model, pg, fsdp::Options().auto_wrap_policy(fsdp::wrap::by_type<torch::nn::LinearImpl>()).reuse_buffers(reuse));
    torch::optim::AdamW opt(sharded->parameters(), torch::optim::AdamWOptions(0.01));
    int64_t after_first = 0;
    for (int step = 0; step < 5; ++step) {
      auto gen = at::detail::createCPUGenerator(10 + step);
      auto x = at::randn({4, 6}, gen);
      opt.zero_grad();
      model->forward(x).pow(2).mean().backward();
      opt.step();
      if (step == 1) after_first = sharded->memory_stats().system_allocations;
    }
    auto stats = sharded->memory_stats();
    const int units = static_cast<int>(sharded->units().size());
    if (reuse) {
      WORKER_CHECK(stats.system_allocations == after_first, "with reuse_buffers, ",
                   stats.system_allocations - after_first, " buffers were allocated after the second iteration");
      WORKER_CHECK(stats.cached_bytes > 0, "nothing cached after training with reuse_buffers");
      sharded->release_cached_memory();
      WORKER_CHECK(sharded->memory_stats().cached_bytes == 0, "release_cached_memory left bytes cached");
    } else {
      // Every non-root unit is gathered and gets a gradient buffer in every iteration.
      WORKER_CHECK(stats.system_allocations - after_first >= 3 * 2 * (units - 1), "without reuse only ",
                   stats.system_allocations - after_first, " allocations in 3 iterations");
      WORKER_CHECK(stats.cached_bytes == 0, "reuse_buffers(false) cached ", stats.cached_bytes, " bytes");
    }
    results.push_back(sharded->full_state_dict());
  }
  for (const auto& kv : results[0])
    WORKER_CHECK(at::equal(kv.second, results[1].at(kv.first)), "parameter ", kv.first,
                 " differs with reuse on and off");
  if (ctx.rank == 0) std::cout << "reuse ok" << std::endl;
}

TEST(BufferPool, ReuseStopsAllocatingAndChangesNoResult) {
  auto r = launch("buffer_reuse_worker", 3);
  ASSERT_TRUE(r.all_ok()) << r.report();
  EXPECT_NE(r.ranks[0].output.find("reuse ok"), std::string::npos) << r.report();
}
