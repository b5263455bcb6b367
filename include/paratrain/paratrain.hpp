#pragma once
/// \file
/// Everything paratrain offers; the MPI, NCCL, Gloo and HDF5 parts when their components
/// are linked (paratrain::mpi, paratrain::nccl, paratrain::gloo, paratrain::hdf5).

// Bottom to top, one group per layer (docs/architecture.md).
#include "paratrain/core/backward_scale.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/config.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/process.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/core/step_result.hpp"
#include "paratrain/core/timeline.hpp"

#include "paratrain/memory/allocator.hpp"
#include "paratrain/memory/counting_allocator.hpp"
#include "paratrain/memory/usage.hpp"

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/concepts/dataset.hpp"
#include "paratrain/concepts/module.hpp"
#include "paratrain/concepts/optimizer.hpp"
#include "paratrain/concepts/sampler.hpp"
#include "paratrain/concepts/strategy.hpp"

#include "paratrain/reliability/failure.hpp"

#include "paratrain/comm/device.hpp"
#include "paratrain/comm/launch.hpp"
#include "paratrain/comm/rendezvous.hpp"
#include "paratrain/comm/single_device.hpp"

#include "paratrain/data/batches.hpp"
#include "paratrain/data/dataset_ref.hpp"
#include "paratrain/data/deterministic_sampler.hpp"
#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/data/exact_sampler.hpp"
#include "paratrain/data/idx_dataset.hpp"
#include "paratrain/data/loader.hpp"
#include "paratrain/data/npy_dataset.hpp"
#include "paratrain/data/sampler_options.hpp"
#include "paratrain/data/sequential_sampler.hpp"
#include "paratrain/data/subset.hpp"
#include "paratrain/data/tensor_dataset.hpp"
#include "paratrain/data/torch_dataset.hpp"
#include "paratrain/data/weighted_sampler.hpp"

#include "paratrain/comm/mesh.hpp"

#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/cross_entropy.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/embeddings.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/tensor_parallel/init.hpp"
#include "paratrain/tensor_parallel/layer_norm.hpp"
#include "paratrain/tensor_parallel/mlp.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/row_parallel_linear.hpp"
#include "paratrain/tensor_parallel/self_attention.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "paratrain/tensor_parallel/transformer_block.hpp"
#include "paratrain/tensor_parallel/vocab_parallel_embedding.hpp"

#include "paratrain/context/all_to_all_attention.hpp"
#include "paratrain/context/attention.hpp"
#include "paratrain/context/layout.hpp"
#include "paratrain/context/ring_attention.hpp"
#include "paratrain/context/self_attention.hpp"
#include "paratrain/experts/mixture_of_experts.hpp"

#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/strategy/buckets/gradient_buckets.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"
#include "paratrain/strategy/buckets/hooks.hpp"
#include "paratrain/strategy/buckets/powersgd.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/deterministic.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/concepts/optimizer_state.hpp"
#include "paratrain/plan/plan.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/stores/sharded_parameters.hpp"
#include "paratrain/strategy/unit.hpp"

#include "paratrain/pipeline/chain.hpp"
#include "paratrain/pipeline/options.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/pipeline/schedule_check.hpp"
#include "paratrain/pipeline/schedule_simulation.hpp"
#include "paratrain/pipeline/stages.hpp"

#include "paratrain/checkpoint/checkpoint.hpp"

#include "paratrain/observe/observer.hpp"

#include "paratrain/fit/callback.hpp"
#include "paratrain/fit/callbacks.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/fit/metrics.hpp"

#include "paratrain/program/main.hpp"

#if PARATRAIN_HAS_MPI
#include "paratrain/comm/mpi/mpi.hpp"
#endif

#if PARATRAIN_HAS_NCCL
#include "paratrain/comm/nccl/bootstrap_over_store.hpp"  // comm::Nccl(comm::Rendezvous&)
#include "paratrain/comm/nccl/nccl.hpp"
#endif
#if PARATRAIN_HAS_NCCL && PARATRAIN_HAS_MPI
#include "paratrain/comm/nccl/bootstrap_over_mpi.hpp"  // comm::Nccl(comm::Mpi&)
#endif

#if PARATRAIN_HAS_GLOO
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/elastic/fit.hpp"  // elastic::fit, elastic::Membership: recovery without a restart
#endif

#if PARATRAIN_HAS_HDF5
#include "paratrain/data/hdf5/hdf5_dataset.hpp"
#endif
