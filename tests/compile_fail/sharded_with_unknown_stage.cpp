// expect: paratrain: the second argument of Sharded is the ZeRO stage: paratrain::zero::stage1, stage2 or stage3
// Sharded's stage is one of three tags; anything else is named at the policy.
#include <torch/torch.h>

#include "paratrain/strategy/sharded.hpp"

paratrain::Sharded<torch::optim::Adam, int> policy;
