#pragma once
// libfsdp: Fully Sharded Data Parallel training for the PyTorch C++ frontend.
#include "fsdp/check.h"
#include "fsdp/comm.h"
#include "fsdp/deferred_init.h"
#include "fsdp/fully_shard.h"
#include "fsdp/memory.h"
#include "fsdp/network_model.h"
#include "fsdp/optim.h"
#include "fsdp/options.h"
#include "fsdp/process_group.h"
#include "fsdp/sharded.h"
#include "fsdp/trace.h"
#include "fsdp/wrap_policy.h"
