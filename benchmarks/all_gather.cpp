// comm::Mpi::all_gather and iall_gather against raw MPI_Allgather on the same buffers,
// out of place and in place (`in` is part rank() of `out`, against MPI_IN_PLACE).
//
// The size is the whole gathered buffer on each rank (`out`); each rank contributes 1/n
// of it. Bus bandwidth as nccl-tests defines it for all-gather: busbw = bytes / time *
// (n-1)/n. Run on 2 ranks:
//   scripts/bench.sh sharding_collectives
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  paratrain::bench::Sizes sizes;
  CLI::App app("all_gather: comm::Mpi's against raw MPI's, message sizes doubling from 4 KiB");
  sizes.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  const std::size_t max_bytes = sizes.max_bytes;
  paratrain::comm::Mpi::Options options;
  if (sizes.segment_bytes) options.sharding_segment_bytes = *sizes.segment_bytes;
  if (sizes.segment_above_bytes) options.all_gather_segment_above_bytes = *sizes.segment_above_bytes;
  paratrain::comm::Mpi world(options);
  const double n = world.size();
  for (const bool in_place : {false, true}) {
    if (world.rank() == 0) {
      const auto above = world.options().all_gather_segment_above_bytes;
      std::printf("\nall_gather (float32, %s), %d ranks, %s\n\n", in_place ? "in place" : "out of place",
                  world.size(),
                  above == SIZE_MAX ? "one MPI call at every size (not segmented)"
                                    : ("segments of " +
                                       paratrain::bench::human_bytes(double(world.options().sharding_segment_bytes)) +
                                       " above " + paratrain::bench::human_bytes(double(above)))
                                          .c_str());
      std::printf("| size | MPI_Allgather%s busbw GB/s | comm::Mpi all_gather GB/s | ratio "
                  "| comm::Mpi iall_gather GB/s | ratio |\n",
                  in_place ? " (MPI_IN_PLACE)" : "");
      std::printf("|---:|---:|---:|---:|---:|---:|\n");
    }
    for (std::size_t bytes = 4096; bytes <= max_bytes; bytes *= 2) {
      // Whole parts at any world size (3 ranks too): `out` is size() parts of `in`.
      const auto part = static_cast<std::int64_t>(bytes / 4) / world.size();
      auto out = torch::ones({part * world.size()});
      const auto in = in_place ? out.narrow(0, world.rank() * part, part) : torch::ones({part});
      const int iterations = static_cast<int>(std::clamp<std::size_t>((std::size_t{128} << 20) / bytes, 3, 2000));
      auto seconds = paratrain::bench::time_alternating(
          world.native(), /*trials=*/5, iterations,
          {[&] {
             MPI_Allgather(in_place ? MPI_IN_PLACE : in.data_ptr(), static_cast<int>(part), MPI_FLOAT, out.data_ptr(),
                           static_cast<int>(part), MPI_FLOAT, world.native());
           },
           [&] { world.all_gather(in, out); },
           [&] { world.iall_gather(in, out).wait(); }});
      if (world.rank() == 0) {
        const auto busbw = [&](double s) { return double(bytes) / s * (n - 1) / n / 1e9; };
        std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
                    paratrain::bench::human_bytes(double(bytes)).c_str(), busbw(seconds[0]), busbw(seconds[1]),
                    seconds[0] / seconds[1], busbw(seconds[2]), seconds[0] / seconds[2]);
        std::fflush(stdout);
      }
    }
  }
}
