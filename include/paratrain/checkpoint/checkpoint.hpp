#pragma once
/// \file
/// paratrain::checkpoint — save, load and reshard any checkpointable strategy's state
/// (docs/checkpoints.md): Checkpointer and save() for sharded training checkpoints,
/// load() for them at any world size and strategy, save_model() / load_model() for one
/// file that PyTorch reads.

#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/checkpoint/format.hpp"
#include "paratrain/checkpoint/load.hpp"
#include "paratrain/checkpoint/model_file.hpp"
#include "paratrain/concepts/optimizer_state.hpp"
#include "paratrain/concepts/checkpointable.hpp"
