#pragma once
// Scheduler: decides when units are unsharded and resharded (paper 3.3-3.4). Every use of a unit
// (an operator reading its parameters, or fsdp::Sharded entering it) comes here: the unit is
// gathered just in time, units the computation left are freed, the next unit's gather is issued
// ahead (forward prefetch, BACKWARD_PRE / BACKWARD_POST), and the rate limiter holds prefetches
// back while too many units are unsharded. Callers hold the FsdpState lock.
#include <vector>

#include "fsdp/options.h"
#include "fsdp/trace.h"
#include "runtime/gradient_reducer.h"
#include "runtime/tracer.h"
#include "runtime/unit.h"

namespace fsdp {

class Scheduler {
 public:
  Scheduler(std::vector<Unit>& units, const Options& options, int rank, Tracer& tracer, GradientReducer& reducer);

  // The scheduling step: the computation (forward, backward, or any other) uses unit u now. On
  // return u's parameters are unsharded and current.
  void use(int u);
  // The explicit form left u's forward: free it (FULL_SHARD / HYBRID_SHARD, not the root).
  void post_forward(int u);
  // Backward began (idempotent within one backward): its unit order is the reverse of forward's.
  void begin_backward();
  // All of u's gradients arrived: reshard u, prefetch (BACKWARD_POST) and reduce its gradients.
  void post_backward(int u);
  // The end of backward: reduce what is left, finish every reduction, reshard everything,
  // broadcast buffers, and start the next iteration (its trace, its prefetch order).
  void finalize_backward(const std::vector<std::pair<std::string, at::Tensor>>& buffers);
  // A backward that ended in an exception (Note [Failed backward]): its issued reductions complete
  // without landing, its unreduced gradients are dropped, every unit is resharded, the next
  // iteration starts.
  void abandon_backward();
  // A backward that reached no gradient hook of this model (autograd::grad with respect to the
  // parameters or other tensors): what it gathered is freed, and the next backward begins afresh;
  // the forward's state stays for it (Note [Backward without parameter gradients]).
  void end_backward_without_gradients();

  // Outside the step (state dicts, explicit unshard): issue u's gathers / gather u now / free u /
  // free every unit.
  void unshard_async(int u) { unshard(u, "explicit"); }
  void unshard_now(int u);
  void reshard(int u);
  void reshard_all();
  // The next use of any unit takes the full scheduling path (after parameters were reloaded).
  void forget_last_used() { last_used_ = -1; }

  // Whether backward frees each unit's parameters (FullyShardedModule::set_reshard_after_backward).
  void set_reshard_after_backward(bool on) { reshard_after_backward_ = on; }
  bool reshard_after_backward() const { return reshard_after_backward_; }

  void enable_trace(bool on) { tracer_.enable(on); }
  const IterationTrace& last_trace() const { return last_trace_; }
  // The calling thread runs a backward pass (the autograd engine's current graph task).
  static bool in_backward();

 private:
  void pre_forward(int u);
  // The end of a backward, either way: units reset and the next iteration's state and trace begun.
  void start_next_iteration();
  void pre_backward(int u);
  // Frees the units u's computation has left behind (`forward`: u is entering its forward).
  void reshard_units_left(int u, bool forward);
  void unshard(int u, const char* why);
  // Gathers v ahead of use unless the rate limiter holds it back; true if v is (being) gathered.
  bool prefetch(int v, const char* why);
  // How many units ahead forward and BACKWARD_PRE prefetch try; the rate limiter holds back the
  // first that does not fit (Note [Prefetch depth]).
  int prefetch_depth() const;
  // Leaving u's forward: free it, or keep it for its backward (Note [Kept for backward]).
  void leave_forward(int u);
  int unsharded_unit_count() const;  // what the rate limiter counts
  // The first unit after u in this backward's order whose backward has not finished (a unit used
  // again after later units finished, such as the root, must not re-gather them) and which the
  // last backward read (Note [Units backward does not read]).
  int next_pending_in_backward(int u) const;
  static int next_in(const std::vector<int>& order, int u);
  // Marks u as run by this forward pass, first starting a new pass if u begins one.
  void note_forward_entry(int u);

  std::vector<Unit>& units_;
  const Options& options_;
  bool reshard_after_backward_ = true;
  int rank_;
  Tracer& tracer_;
  GradientReducer& reducer_;

  int last_used_ = -1;
  bool backward_started_ = false;
  // Execution order (Note [Execution order]): units in the order this forward first used them
  // (the next forward prefetches along it), and in the order they were last used in forward
  // (reversed: this backward's order).
  std::vector<int> forward_first_order_, previous_forward_order_, forward_last_order_, backward_order_;
  // Units the current forward pass entered, with or without grad (Note [Forward prefetch]); a pass
  // begins when the unit the previous forward began with is entered again.
  std::vector<char> ran_in_forward_;
  int held_back_prefetch_ = -1;  // held back by the rate limiter until a reshard makes room
  // Note [Kept for backward]: the non-root unit the last backward used first (-1: none, or a
  // ReshardPolicy decides), and the unit this forward kept unsharded for its backward (-1: none).
  int first_in_backward_ = -1;
  int kept_for_backward_ = -1;
  // Units whose gradients are all in but whose frozen parameters the rest of their backward (the
  // gradient of their inputs) still reads: resharded when backward's computation leaves them (Note
  // [Frozen parameters in backward]).
  std::vector<int> lingering_;
  void reshard_lingering_left(int u);
  const char* held_back_why_ = "";
  // Per unit: whether this backward read its parameters, and whether the last one reached it
  // without reading them (Note [Units backward does not read]).
  std::vector<char> read_in_backward_, unread_in_backward_;
  IterationTrace last_trace_;
};

}  // namespace fsdp
