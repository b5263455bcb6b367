// expect: write paratrain::Unit<paratrain::Recompute<Layer>>, not Recompute<Unit<Layer>>
// ZeRO-3 must gather a unit's parameters before its activations are recomputed: the
// reverse nesting is refused, naming the order that works.
#include <torch/torch.h>

#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/unit.hpp"

paratrain::Recompute<paratrain::Unit<torch::nn::Linear>> layer(4, 2);
