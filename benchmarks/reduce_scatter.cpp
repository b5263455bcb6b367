// comm::Mpi::reduce_scatter and ireduce_scatter against raw MPI_Reduce_scatter_block on
// the same buffers.
//
// The size is the whole buffer each rank reduces (`in`); each rank keeps 1/n of it.
// Bus bandwidth as nccl-tests defines it for reduce-scatter: busbw = bytes / time *
// (n-1)/n. Run on 2 ranks:
//   scripts/bench.sh sharding_collectives
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  paratrain::bench::Sizes sizes;
  CLI::App app("reduce_scatter: comm::Mpi's against raw MPI's, message sizes doubling from 4 KiB");
  sizes.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  const std::size_t max_bytes = sizes.max_bytes;
  paratrain::comm::Mpi::Options options;
  if (sizes.segment_bytes) options.sharding_segment_bytes = *sizes.segment_bytes;
  if (sizes.segment_above_bytes) options.reduce_scatter_segment_above_bytes = *sizes.segment_above_bytes;
  paratrain::comm::Mpi world(options);
  const double n = world.size();
  if (world.rank() == 0) {
    std::printf("reduce_scatter (sum, float32), %d ranks, segments of %s above %s\n\n", world.size(),
                paratrain::bench::human_bytes(double(world.options().sharding_segment_bytes)).c_str(),
                paratrain::bench::human_bytes(double(world.options().reduce_scatter_segment_above_bytes)).c_str());
    std::printf("| size | MPI_Reduce_scatter_block busbw GB/s | comm::Mpi reduce_scatter GB/s | ratio "
                "| comm::Mpi ireduce_scatter GB/s | ratio |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
  }
  for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 2) {
    // Whole parts at any world size (3 ranks too): `in` is size() parts of `out`.
    auto out = torch::empty({static_cast<std::int64_t>(bytes / 4) / world.size()});
    const auto in = torch::ones({out.numel() * world.size()});
    const int iterations = static_cast<int>(std::clamp<std::size_t>((std::size_t{128} << 20) / bytes, 3, 2000));
    auto seconds = paratrain::bench::time_alternating(
        world.native(), /*trials=*/5, iterations,
        {[&] {
           MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), static_cast<int>(out.numel()), MPI_FLOAT, MPI_SUM,
                                    world.native());
         },
         [&] { world.reduce_scatter(in, out, paratrain::reduce_op::sum); },
         [&] { world.ireduce_scatter(in, out, paratrain::reduce_op::sum).wait(); }});
    if (world.rank() == 0) {
      const auto busbw = [&](double s) { return double(bytes) / s * (n - 1) / n / 1e9; };
      std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", paratrain::bench::human_bytes(double(bytes)).c_str(),
                  busbw(seconds[0]), busbw(seconds[1]), seconds[0] / seconds[1], busbw(seconds[2]),
                  seconds[0] / seconds[2]);
      std::fflush(stdout);
    }
  }
}
