// Module types the wrappers and wrap policies refuse at compile time, each with the message it
// must give: tests/expect_compile_errors.cmake compiles this file, expects it to fail, and finds
// in the compiler's output each regular expression (CMake's) written after "expect:" below.
#include <fsdp/activation_checkpoint.h>
#include <fsdp/sharded.h>
#include <fsdp/wrap_policy.h>

namespace {

struct OverloadedImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) { return x; }
  at::Tensor forward(const at::Tensor& x, const at::Tensor& y) { return x + y; }
};
TORCH_MODULE(Overloaded);

struct TemplateForwardImpl : torch::nn::Module {
  template <typename T>
  T forward(T x) {
    return x;
  }
};
TORCH_MODULE(TemplateForward);

struct DefaultedImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x, double scale = 2.0) { return x * scale; }
};
TORCH_MODULE(Defaulted);

// expect: wrap::by_type<M...>\(\): each M must be a module class \(BlockImpl
void by_type_of_a_non_module() { fsdp::wrap::by_type<int>(); }

// expect: fsdp::Sharded<M>: M must be a module holder
void sharded_non_module() { fsdp::Sharded<int> s(nullptr); }

// expect: fsdp::Sharded<M>: M's forward must be one member function, neither overloaded nor a template
void sharded_overloaded() { fsdp::Sharded<Overloaded> s(Overloaded{}); }

// expect: fsdp::Checkpointed<M>: M's forward must be one member function, neither overloaded nor a template
void checkpointed_template_forward() { fsdp::Checkpointed<TemplateForward> c(TemplateForward{}); }

// A ModuleList has no forward. (The message above, for Sharded.)
void sharded_module_list() { fsdp::Sharded<torch::nn::ModuleList> s(torch::nn::ModuleList{}); }

// expect: fsdp::Sharded<M, Result\(Args...\)>: M's forward cannot be called with arguments of types
void sharded_wrong_signature() { fsdp::Sharded<torch::nn::Linear, at::Tensor(int, int)> s(torch::nn::Linear(2, 2)); }

// expect: fsdp::Checkpointed<M, Forward>: Forward must be a function type
void checkpointed_not_a_function_type() {
  fsdp::Checkpointed<torch::nn::Linear, at::Tensor> c(torch::nn::Linear(2, 2));
}

// expect: fsdp::Checkpointed<fsdp::Sharded<M>> is not supported
void checkpointed_sharded() {
  fsdp::Checkpointed<fsdp::Sharded<torch::nn::Linear>> c(fsdp::Sharded<torch::nn::Linear>(torch::nn::Linear(2, 2)));
}

// A defaulted argument cannot be left out of a call of the wrapper's forward (a non-template
// function, as torch::nn::AnyModule requires): the compiler names the arguments it expects.
// expect: (candidate expects 2 arguments, 1 provided|requires 2 arguments, but 1 was provided)
void defaulted_argument_left_out() {
  fsdp::Sharded<Defaulted> s(Defaulted{});
  s->forward(at::ones({1}));
}

}  // namespace
