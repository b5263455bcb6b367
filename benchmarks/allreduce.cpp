// comm::Mpi::all_reduce against raw MPI_Allreduce on the same buffers.
//
// Bus bandwidth as nccl-tests defines it: busbw = bytes / time * 2(n-1)/n, the rate at
// which each rank's link must move data for a ring all-reduce. Run on 2 ranks:
//   scripts/bench.sh allreduce
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  paratrain::bench::Sizes sizes;
  CLI::App app("allreduce: comm::Mpi's against raw MPI's, message sizes doubling from 4 KiB");
  sizes.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  const std::size_t max_bytes = sizes.max_bytes;
  paratrain::comm::Mpi::Options options;
  if (sizes.segment_bytes) options.segment_bytes = *sizes.segment_bytes;
  if (sizes.segment_above_bytes) options.segment_above_bytes = *sizes.segment_above_bytes;
  paratrain::comm::Mpi world(options);
  const double n = world.size();
  if (world.rank() == 0) {
    std::printf("all_reduce (sum, float32, in place), %d ranks, segments of %s above %s\n\n", world.size(),
                paratrain::bench::human_bytes(double(world.options().segment_bytes)).c_str(),
                paratrain::bench::human_bytes(double(world.options().segment_above_bytes)).c_str());
    std::printf("| size | MPI_Allreduce busbw GB/s | comm::Mpi all_reduce GB/s | ratio | comm::Mpi iall_reduce GB/s | ratio |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|\n");
  }
  for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 2) {
    auto t = torch::ones({static_cast<std::int64_t>(bytes / 4)});
    const int iterations = static_cast<int>(std::clamp<std::size_t>((std::size_t{128} << 20) / bytes, 3, 2000));
    auto seconds = paratrain::bench::time_alternating(
        world.native(), /*trials=*/5, iterations,
        {[&] {
           MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), static_cast<int>(t.numel()), MPI_FLOAT, MPI_SUM,
                         world.native());
         },
         [&] { world.all_reduce(t, paratrain::reduce_op::sum); },
         [&] { world.iall_reduce(t, paratrain::reduce_op::sum).wait(); }});
    if (world.rank() == 0) {
      const auto busbw = [&](double s) { return double(bytes) / s * 2 * (n - 1) / n / 1e9; };
      std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", paratrain::bench::human_bytes(double(bytes)).c_str(),
                  busbw(seconds[0]), busbw(seconds[1]), seconds[0] / seconds[1], busbw(seconds[2]),
                  seconds[0] / seconds[2]);
      std::fflush(stdout);
    }
  }
}
