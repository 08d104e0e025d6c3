#pragma once
// fully_shard(): apply FSDP to an unmodified module tree; FullyShardedModule: the handle the user
// keeps. The model keeps its parameters (names, shapes, identities); their storage becomes FSDP's,
// gathered just in time and freed after use. Rules: docs/usage.md ("Rules that come with sharding").
#include <torch/torch.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "fsdp/check.h"
#include "fsdp/memory.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "fsdp/trace.h"

namespace fsdp {

class FsdpState;
class Hooks;
namespace detail {
struct StateAccess;  // libfsdp's own code (src/) reaches the runtime behind a handle through it
}

// One original parameter's part on this rank (FullyShardedModule::shard_pieces()).
struct ShardPiece {
  std::string name;            // the original parameter's qualified name
  at::Tensor piece;            // the 1-D leaf the optimizer steps; after backward, its .grad is the gradient's part
  std::vector<int64_t> shape;  // the original parameter's shape
  int64_t begin = 0;           // `piece` holds elements [begin, begin + piece.numel()) of the flattened parameter
};

// What FullyShardedModule::summon_full_params shows and keeps.
struct FullParamsOptions {
  /// When the guard ends, copy into the shards what was written into the parameters (in place, or as new data of the same shape, as torch::load does).
  TORCH_ARG(bool, writeback) = false;
  /// While the guard lives, each parameter's .grad is its whole reduced gradient (undefined where no rank has one); changes to it are dropped.
  TORCH_ARG(bool, with_grads) = false;
};

// One unit as FSDP built it (for printing, tests and memory estimates).
struct UnitInfo {
  std::string name;  // qualified module name; "" for the root
  int parent = -1;   // index of the enclosing unit; -1 for the root
  std::vector<std::string> parameters;
  int64_t numel = 0;                  // sum over its FlatParameters of unpadded elements
  int64_t padded_numel = 0;           // after right-padding each FlatParameter to a multiple of F
  int64_t padded_bytes = 0;           // unsharded size in bytes
  int64_t shard_bytes = 0;            // this rank's shard in bytes
  bool quantized_gathers = false;     // Options::all_gather_quantization applies to a FlatParameter of it
  bool quantized_reductions = false;  // Options::reduce_quantization applies to a FlatParameter of it
};

class FullyShardedModule {
 public:
  ~FullyShardedModule();
  FullyShardedModule(const FullyShardedModule&) = delete;
  FullyShardedModule& operator=(const FullyShardedModule&) = delete;

  // The local shard pieces, one leaf tensor per original parameter that overlaps this rank's
  // shard (1-D), for the optimizer. Frozen parameters' pieces are included with requires_grad
  // false (optimizers skip them: they never get gradients).
  std::vector<at::Tensor> parameters() const;
  // The same pieces under the original parameters' names.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  // The same pieces with each original parameter's shape and the elements the piece holds (a
  // contiguous range of the flattened parameter; ranks hold consecutive ranges, in rank order, and
  // some none): e.g. to group them for an optimizer by the original parameter's dimensions.
  std::vector<ShardPiece> shard_pieces() const;
  // Collective over the shard group: the `norm_type`-norm (p > 0, or infinity) of each original
  // parameter's gradient after backward, by name, in parameter order, equal on every rank; only
  // parameters whose gradient exists (not frozen, used in this backward). A sharded parameter's own
  // .grad is a placeholder, not its gradient: see docs/usage.md ("Gradients").
  std::vector<std::pair<std::string, double>> grad_norms(double norm_type = 2.0);
  // What Options::ignored_modules / ignored_parameters left alone, by first name: whole,
  // rank-local tensors that parameters() does not include (see docs/usage.md, "Ignored modules").
  std::vector<std::pair<std::string, at::Tensor>> ignored_parameters() const;
  // Collective over the world: averages the ignored parameters' gradients over the ranks (a rank
  // without one counts zeros), as FSDP does for its own; they then stay equal across ranks.
  void all_reduce_ignored_gradients();
  // Throws if `params` (e.g. an optimizer's parameters) contains an original parameter of the
  // sharded module instead of a shard piece.
  void check_optimizer_parameters(const std::vector<at::Tensor>& params) const;
  // Also throws for torch::optim::LBFGS on more than one rank (fsdp::LBFGS is L-BFGS over shards).
  void check_optimizer(const torch::optim::Optimizer& optimizer) const;

  // Collective: every rank gets every parameter (unsharded, cloned) and buffer by name.
  std::unordered_map<std::string, at::Tensor> full_state_dict();
  // Every name full_state_dict() has (parameters under each of their names, and buffers), in no
  // particular order. Not collective.
  std::vector<std::string> full_state_names() const;
  // Collective: calls visit(name, value) for each of `names` (of full_state_names(), the same list
  // on every rank) in that order, gathering one FlatParameter at a time (again when the order comes
  // back to it), so memory holds one unit's full values, not the model's. A value is valid during
  // its call only.
  void visit_full_state(const std::vector<std::string>& names,
                        const std::function<void(const std::string& name, const at::Tensor& value)>& visit);
  // Collective: loads full tensors by name into the shards (and buffers); names and shapes must be
  // full_state_dict()'s, none missing or extra, checked on every rank before any value changes.
  void load_full_state_dict(const std::unordered_map<std::string, at::Tensor>& state);

  // Collective: clips the gradients of all ranks' pieces to a total `norm_type`-norm (p > 0, or
  // infinity) of at most `max_norm`, as torch::nn::utils::clip_grad_norm_ would on the whole
  // model; returns the total norm before clipping (equal on every rank).
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);

  // Optimizer step in backward: while set, every backward that reduces gradients steps `optimizer`
  // on each unit's shard pieces as soon as their reduced gradients are in, overlapping the step
  // with the reductions still running, and then drops those gradients (a later optimizer.step()
  // skips them). The result equals a step after backward; backward returns once every step ran.
  // `thread` says where the steps run (StepThread). `optimizer` must hold every trainable piece
  // and outlive the setting; nullptr turns it off. Refused: clip_grad_norm_ and GradScaler while
  // set. Every rank must set it alike. See Notes [Step in backward], [Step on its own thread].
  void set_step_in_backward(torch::optim::Optimizer* optimizer, StepThread thread = StepThread::kAuto);

  // Gradient accumulation without communication: while off, backward keeps each unit's unsharded
  // gradient and adds later backwards into it, with no reduction; the first backward with it on
  // again reduces the sum. Not collective, but every rank must switch at the same backward.
  void set_requires_gradient_sync(bool sync);
  bool requires_gradient_sync() const;
  // RAII form (FSDP's no_sync()): off while the guard lives.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(FullyShardedModule& module) : module_(&module), previous_(module.requires_gradient_sync()) {
      module.set_requires_gradient_sync(false);
    }
    ~NoSyncGuard() {
      if (module_) module_->set_requires_gradient_sync(previous_);
    }
    NoSyncGuard(NoSyncGuard&& other) noexcept : module_(other.module_), previous_(other.previous_) {
      other.module_ = nullptr;
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(NoSyncGuard&&) = delete;

   private:
    FullyShardedModule* module_;
    bool previous_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }
  // HYBRID_SHARD accumulation (FSDP2's set_requires_all_reduce): while off, backward
  // reduce-scatters within each shard group and keeps the shard's sum, skipping the all-reduce
  // across replicas; the first backward with it on again reduces everything kept. Every rank must
  // switch at the same backward. No effect on the other strategies.
  void set_requires_all_reduce(bool on);
  // Deterministic mode's padding backwards (Options::deterministic only): while off, backward runs
  // as usual, collectives included, but its gradients are dropped and it does not count in the mean
  // over backward passes, so a rank with fewer micro-batches than the others can keep step with
  // them. Not collective. See Note [Deterministic training] in docs/design.md.
  void set_backward_counted(bool counted);
  // While off, backward leaves the units unsharded, so the next forward (e.g. the next micro-batch
  // under no_sync) gathers nothing; after an optimizer step they are gathered again (FSDP2's
  // set_reshard_after_backward). More memory: every unit stays unsharded. Every rank must switch
  // at the same backward.
  void set_reshard_after_backward(bool on);

  // Explicit unshard (FSDP2's unshard(async_op)): collective; issues every unit's all-gather and
  // returns at once; wait() blocks until they have landed. The next forward uses them (and
  // reshards them as usual); reshard() frees them (not collective).
  class UnshardHandle {
   public:
    void wait();
    UnshardHandle(UnshardHandle&&) noexcept;
    ~UnshardHandle();

   private:
    friend class FullyShardedModule;
    explicit UnshardHandle(FullyShardedModule* module) : module_(module) {}
    FullyShardedModule* module_;
  };
  [[nodiscard]] UnshardHandle unshard();
  void reshard();

  // Full parameters for evaluation, generation or inspection (FSDP's summon_full_params): while
  // the guard lives, every parameter of the module holds its whole value in the shards' dtype (full
  // precision under mixed precision), in a new tensor; FullParamsOptions says what else it shows and
  // what it writes back. Collective to create. Run the model under torch::NoGradGuard inside it: no
  // training step may happen while it lives.
  class FullParamsGuard {
   public:
    FullParamsGuard(FullParamsGuard&&) noexcept;
    ~FullParamsGuard();

   private:
    friend class FullyShardedModule;
    struct Saved;
    FullParamsGuard(FullyShardedModule* module, const FullParamsOptions& options);
    FullyShardedModule* module_;
    FullParamsOptions options_;
    std::unique_ptr<Saved> saved_;
  };
  [[nodiscard]] FullParamsGuard summon_full_params(bool writeback = false);
  [[nodiscard]] FullParamsGuard summon_full_params(const FullParamsOptions& options);

  MemoryStats memory_stats() const;
  void reset_peak_memory_stats();
  // Frees the idle buffers kept for reuse (MemoryStats::cached_bytes), e.g. before evaluation
  // with another model. Not collective.
  void release_cached_memory();

  const std::vector<UnitInfo>& units() const;
  ShardingStrategy sharding_strategy() const;
  int sharding_factor() const;  // ranks a FlatParameter is split over (1 for kNoShard)
  int world_size() const;
  // Mixed precision: `input` cast to MixedPrecision::param_dtype if both are floating point and
  // cast_forward_inputs is on (for the root's inputs, which FSDP does not see; explicit units cast
  // theirs). Else `input` itself.
  at::Tensor cast_forward_input(at::Tensor input) const;
  std::shared_ptr<torch::nn::Module> module() const;
  // A table of units, sizes and the strategy, then the communicators and their transports, for logs.
  std::string describe() const;

  // Event trace (also Options::trace): when on, every backward completes an iteration's trace,
  // available from last_trace() until the next one completes.
  void set_trace(bool on);
  IterationTrace last_trace() const;

 protected:
  // Applies FSDP (fully_shard()).
  FullyShardedModule(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg, Options options);
  // Around the root's forward (FullyShardedModuleOf::forward): forgets earlier dtype hints; then,
  // for an exception `e` that escaped it, throws fsdp::Error with e's message and the hint of the
  // operator that failed on mixing param_dtype with a wider input, or returns if there is none.
  static void begin_root_forward();
  static void rethrow_with_dtype_hint(const std::exception& e);

 private:
  friend struct detail::StateAccess;
  friend std::shared_ptr<FullyShardedModule> fully_shard(std::shared_ptr<torch::nn::Module>, ProcessGroupPtr, Options);

  std::unique_ptr<FsdpState> state_;
  std::unique_ptr<Hooks> hooks_;  // removed before the state they call goes
  std::vector<UnitInfo> units_;
};

// Applies FSDP to `module` in place. Collective over `pg`: every rank must call it with a model
// of the same structure (checked: a mismatch names the first differing parameter).
std::shared_ptr<FullyShardedModule> fully_shard(std::shared_ptr<torch::nn::Module> module, ProcessGroupPtr pg,
                                                Options options = {});

// What fully_shard() returns for a module holder: the handle, and the root module's forward.
template <typename ModuleImpl>
class FullyShardedModuleOf : public FullyShardedModule {
 public:
  FullyShardedModuleOf(std::shared_ptr<ModuleImpl> impl, ProcessGroupPtr pg, Options options)
      : FullyShardedModule(impl, std::move(pg), std::move(options)), impl_(std::move(impl)) {}

  // The root module's forward, its tensor arguments cast by cast_forward_input() (PyTorch FSDP's
  // cast of the root's inputs); other arguments pass as given.
  template <typename... Args>
  decltype(auto) forward(Args&&... args) {
    begin_root_forward();
    try {
      return impl_->forward(cast_root_argument(std::forward<Args>(args))...);
    } catch (const std::exception& e) {
      rethrow_with_dtype_hint(e);
      throw;
    }
  }

 private:
  template <typename A>
  decltype(auto) cast_root_argument(A&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>)
      return cast_forward_input(arg);
    else
      return std::forward<A>(arg);
  }

  std::shared_ptr<ModuleImpl> impl_;
};

template <typename ModuleImpl>
std::shared_ptr<FullyShardedModuleOf<ModuleImpl>> fully_shard(torch::nn::ModuleHolder<ModuleImpl>& module,
                                                              ProcessGroupPtr pg, Options options = {}) {
  FSDP_CHECK(!module.is_empty(), "fully_shard: the module is null");
  return std::make_shared<FullyShardedModuleOf<ModuleImpl>>(module.ptr(), std::move(pg), std::move(options));
}

}  // namespace fsdp
