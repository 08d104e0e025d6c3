// CpuOffloader on the device: a host cast before the copy gives the device cast's bits, its
// staging survives callers that drop the work, and offloaded mixed-precision training is unchanged.
#include <c10/cuda/CUDAFunctions.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <vector>

#include "cpu_offload.h"
#include "harness.h"

namespace {

using fsdp_test::kGpu;

// Float32 values that stress a cast to bfloat16: ties, subnormals, overflow to infinity, NaN.
at::Tensor awkward_values(int64_t n) {
  at::Tensor t = torch::randn({n}) * 1e3;
  const float specials[] = {0.0f,
                            -0.0f,
                            1.00390625f,
                            1.01171875f,
                            -1.00390625f,
                            3.4e38f,
                            -3.4e38f,
                            1e-39f,
                            -1e-39f,
                            1e-45f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::min()};
  int64_t i = 0;
  for (float v : specials) t[i++] = v;
  return t;
}

TEST(GpuCpuOffload, HostCastGivesTheDeviceCastsBits) {
  REQUIRE_GPU();
  fsdp::CpuOffloader offload(kGpu, /*pin_memory=*/true);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const int64_t n = (1 << 20) + 7;
    at::Tensor src = offload.host_empty(n, at::kFloat);
    src.copy_(awkward_values(n));
    at::Tensor on_host = torch::empty({n}, torch::TensorOptions().dtype(dtype).device(kGpu));
    at::Tensor on_device = torch::empty_like(on_host);
    offload.to_device(on_host, src, /*cast_on_host=*/true)->wait();
    offload.to_device(on_device, src, /*cast_on_host=*/false)->wait();
    c10::cuda::device_synchronize();
    const at::Tensor a = on_host.view(at::kShort).cpu(), b = on_device.view(at::kShort).cpu();
    const at::Tensor nan = on_host.isnan().cpu();
    EXPECT_TRUE(nan.equal(on_device.isnan().cpu())) << dtype;
    // NaN payloads may differ; every other value bit for bit.
    EXPECT_TRUE(a.masked_select(~nan).equal(b.masked_select(~nan))) << dtype;
    EXPECT_EQ(on_host.cpu().to(at::kFloat)[n - 1].item<float>(), src[n - 1].to(dtype).item<float>());
  }
}

TEST(GpuCpuOffload, StagingOutlivesWorkTheCallerDrops) {
  REQUIRE_GPU();
  fsdp::CpuOffloader offload(kGpu, /*pin_memory=*/true);
  const int64_t n = 1 << 22;
  at::Tensor src = offload.host_empty(n, at::kFloat);
  std::vector<at::Tensor> dsts;
  std::vector<at::Tensor> expected;
  // Many casts queued behind a long device computation, each work dropped at once: a staging
  // tensor reused before its copy ran would show another round's values.
  at::Tensor a = torch::randn({4096, 4096}, torch::TensorOptions().device(kGpu));
  for (int round = 0; round < 12; ++round) {
    a = a.mm(a).tanh();
    src.fill_(static_cast<float>(round) + 0.5f);
    dsts.push_back(torch::empty({n}, torch::TensorOptions().dtype(at::kBFloat16).device(kGpu)));
    offload.to_device(dsts.back(), src, /*cast_on_host=*/true);
    expected.push_back(torch::full({n}, static_cast<float>(round) + 0.5f).to(at::kBFloat16));
  }
  c10::cuda::device_synchronize();
  for (size_t i = 0; i < dsts.size(); ++i) EXPECT_TRUE(dsts[i].cpu().equal(expected[i])) << "round " << i;
}

}  // namespace
