// A downstream program that builds paratrain with add_subdirectory: it shards a data
// set with DistributedSampler over the ranks of comm::Mpi and checks, with an
// all-reduce, that every index was handed out exactly once. Exit status 0 when so.
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstdio>

#include <paratrain/comm/mpi/mpi.hpp>
#include <paratrain/data/distributed_sampler.hpp>

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  paratrain::comm::Mpi world;

  // 12 samples divide evenly over 1, 2, 3, 4 or 6 ranks, so nothing is padded.
  constexpr std::int64_t samples = 12;
  paratrain::data::DistributedSampler sampler(samples, {.num_replicas = world.size(), .rank = world.rank(), .seed = 7});
  sampler.set_epoch(1);

  auto seen = at::zeros({samples});
  for (const auto index : sampler.indices()) seen[index] += 1;
  world.all_reduce(seen, paratrain::reduce_op::sum);

  const bool ok = seen.eq(1).all().item<bool>();
  std::printf("rank %d of %d: %lld indices, every sample seen once: %s\n", world.rank(), world.size(),
              static_cast<long long>(sampler.size()), ok ? "OK" : "WRONG");
  return ok ? 0 : 1;
}
