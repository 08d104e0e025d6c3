#include "runtime/parameter_misuse.h"

#include "fsdp/check.h"

namespace fsdp {

std::string in_place_write_error(const char* op, const std::string& what) {
  const bool set = std::string(op) == "aten::set_";
  return detail::compose("libfsdp: in-place operation ", op, " on ", what, ": the change is lost at the next reshard. ",
                         set ? "torch::load(module, path) replaces parameters this way: call it before fully_shard(), "
                               "or on every rank inside summon_full_params(/*writeback=*/true). "
                             : "",
                         "If this is an optimizer "
                         "step, build the optimizer over FullyShardedModule::parameters() (the shards), not "
                         "module->parameters(); to set values use load_full_state_dict() or "
                         "summon_full_params(/*writeback=*/true); to initialize, do it before fully_shard().");
}

std::string replaced_parameter_error(const std::string& name) {
  return detail::compose(
      "parameter '", name,
      "' no longer shows FSDP's storage: module->to(dtype or device), torch::load(module, path), set_data() or an "
      "assignment to its data replaced it after fully_shard(), so its updates and gradients no longer meet the shards. "
      "Move or cast the "
      "model before fully_shard() (for a lower compute dtype, Options::mixed_precision); to set values (torch::load "
      "included) use load_full_state_dict() or summon_full_params(/*writeback=*/true); to initialize, do it before "
      "fully_shard().");
}

std::string retired_storage_error(const char* op, const std::string& name) {
  return detail::compose(
      "libfsdp: operator ", op, " read a tensor over the memory parameter '", name,
      "' had before fully_shard(): a view of it or its .data(), made before fully_shard() and kept (e.g. a module "
      "member set to weight.t() in its constructor). fully_shard() moved the parameter into FSDP's storage, so "
      "that tensor still shows the initial values, not the trained ones. Make such views inside forward, from the "
      "module's parameter");
}

std::string placeholder_read_error(const char* op, const std::string& name) {
  return detail::compose(
      "libfsdp: operator ", op, " read the .grad of parameter '", name,
      "' of a sharded module, which is a placeholder (zeros), not its gradient: after backward a sharded "
      "parameter's gradient is in its shard pieces. Read them with FullyShardedModule::shard_pieces() (each "
      "piece's .grad, with the parameter's name and shape), each parameter's gradient norm with grad_norms(), or "
      "whole gradients inside summon_full_params(FullParamsOptions().with_grads(true)); "
      "clip them with FullyShardedModule::clip_grad_norm_(). An optimizer reads gradients too: build the "
      "optimizer over FullyShardedModule::parameters() (the shards)");
}

}  // namespace fsdp
