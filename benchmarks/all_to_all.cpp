// comm::Mpi::all_to_all and iall_to_all against raw MPI_Alltoall, MPI_Alltoallv and
// MPI_Ialltoallv on the same buffers: the equal form against MPI_Alltoall, the form with
// per-rank counts (here equal counts, the same messages) against MPI_Alltoallv, and its
// non-blocking form, waited for at once, against MPI_Ialltoallv and MPI_Wait.
//
// The size is each rank's whole `in` (and `out`); a rank sends 1/n of it to each rank. Bus
// bandwidth as nccl-tests defines it for all-to-all: busbw = bytes / time * (n-1)/n. Run on
// 2 ranks:
//   scripts/bench.sh all_to_all
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  paratrain::bench::Sizes sizes;
  CLI::App app("all_to_all: comm::Mpi's against raw MPI's, message sizes doubling from 4 KiB");
  sizes.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  paratrain::comm::Mpi world;
  const int n = world.size();
  if (world.rank() == 0) {
    std::printf("\nall_to_all (float32), %d ranks: busbw GB/s (median over trials), and raw's time / comm::Mpi's (median "
                "of each trial's)\n\n", n);
    std::printf("| size | MPI_Alltoall | all_to_all(in, out) | ratio | MPI_Alltoallv | all_to_all(in, counts, out, "
                "counts) | ratio | MPI_Ialltoallv + MPI_Wait | iall_to_all(counts).wait() | ratio |\n");
    std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  }
  for (std::size_t bytes = 4096; bytes <= sizes.max_bytes; bytes *= 2) {
    const auto part = static_cast<std::int64_t>(bytes / 4) / n;  // whole parts at any world size
    const auto in = torch::ones({part * n});
    auto out = torch::empty({part * n});
    const std::vector<std::int64_t> counts(static_cast<std::size_t>(n), part);
    std::vector<int> raw_counts(static_cast<std::size_t>(n), static_cast<int>(part)), offsets;
    for (int i = 0; i < n; ++i) offsets.push_back(static_cast<int>(i * part));
    // ~128 MiB a trial (32,768 calls of 4 KiB: 20-70 ms, where 2,000 calls made a trial of a
    // few ms, within the scheduler's noise); from 32 MiB, a few calls a trial and more trials:
    // the same MPI call on both sides there, whose time varies with the machine's memory
    // traffic from call to call. The ratios are the medians of each trial's (time_paired):
    // 15 trials of 6 candidates below 32 MiB, ~10 s a size.
    const int iterations = static_cast<int>(std::max<std::size_t>((std::size_t{128} << 20) / bytes, 5));
    const int trials = bytes >= (std::size_t{32} << 20) ? 9 : 15;
    const auto times = paratrain::bench::time_paired(
        world.native(), trials, iterations,
        {[&] {
           MPI_Alltoall(in.data_ptr(), static_cast<int>(part), MPI_FLOAT, out.data_ptr(), static_cast<int>(part),
                        MPI_FLOAT, world.native());
         },
         [&] { world.all_to_all(in, out); },
         [&] {
           MPI_Alltoallv(in.data_ptr(), raw_counts.data(), offsets.data(), MPI_FLOAT, out.data_ptr(), raw_counts.data(),
                         offsets.data(), MPI_FLOAT, world.native());
         },
         [&] { world.all_to_all(in, counts, out, counts); },
         [&] {
           MPI_Request request = MPI_REQUEST_NULL;
           MPI_Ialltoallv(in.data_ptr(), raw_counts.data(), offsets.data(), MPI_FLOAT, out.data_ptr(),
                          raw_counts.data(), offsets.data(), MPI_FLOAT, world.native(), &request);
           MPI_Wait(&request, MPI_STATUS_IGNORE);
         },
         [&] { world.iall_to_all(in, counts, out, counts).wait(); }});
    if (world.rank() == 0) {
      const auto busbw = [&](std::size_t c) { return double(bytes) / times.seconds(c) * (n - 1) / n / 1e9; };
      std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
                  paratrain::bench::human_bytes(double(bytes)).c_str(), busbw(0), busbw(1), times.ratio(0, 1), busbw(2),
                  busbw(3), times.ratio(2, 3), busbw(4), busbw(5), times.ratio(4, 5));
      std::fflush(stdout);
    }
  }
}
