#pragma once
// An embedding's max_norm: its lookup renormalizes, in place, the rows its indices name. Every rank
// renormalizes the rows that any rank's batch names, so that the parameter stays what training on
// the global batch makes it (Note [Embedding max_norm] in docs/design.md).
#include <ATen/record_function.h>
#include <torch/torch.h>

#include "flat_param.h"

namespace fsdp {

// True for aten::embedding_renorm_ (F::embedding and F::embedding_bag with max_norm).
bool is_embedding_renorm(const char* op);

// True if `module` or a module under it is an Embedding or EmbeddingBag with max_norm set.
bool has_max_norm_embedding(const torch::nn::Module& module);

// Called as `fn`, an embedding_renorm_ of the parameter in `slot` of `fp`, begins, by every rank of
// the world alike (collective over it): renormalizes in the parameter the rows that other ranks'
// indices name and this rank's do not (the operator does this rank's) and, where the shard is not
// the parameter's storage, scales the shard's part of every row renormalized anywhere alike.
void renorm_rows_of_every_rank(const at::RecordFunction& fn, FlatParam& fp, const ParamSlot& slot);

}  // namespace fsdp
