#pragma once
/// \file
/// Mapping of tensor dtypes and reductions onto MPI datatypes and operations.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <mpi.h>

#include <algorithm>
#include <cstdlib>

#include "paratrain/core/reduce_op.hpp"

namespace paratrain::detail {

// Note [16-bit reductions]
// MPI has no bfloat16 or float16 type. 16-bit buffers travel as MPI_UINT16_T; their
// reductions are user-defined operations that widen each pair to float, combine and
// round back, which is what c10::BFloat16/c10::Half arithmetic does (and what
// Gloo does for these types), so summation order is the only difference to a float
// reduction rounded once.
template <class T, class Combine>
void combine_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(Combine{}(static_cast<float>(a[i]), static_cast<float>(b[i])));
}

struct plus_f {
  float operator()(float a, float b) const noexcept { return a + b; }
};
struct max_f {
  float operator()(float a, float b) const noexcept { return std::max(a, b); }
};
struct min_f {
  float operator()(float a, float b) const noexcept { return std::min(a, b); }
};

// Note [Non-blocking all-reduce algorithm]
// Open MPI 4.1's libnbc runs MPI_Iallreduce as a binomial reduce followed by a
// broadcast whenever there are fewer than 4 ranks or the call is in place, which
// DataParallel's bucket all-reduces are: 2.4 ms for 7.45 MB on 2 ranks here, against
// 0.93 ms for its reduce-scatter + all-gather algorithm (3) and 1.2 ms for the blocking
// MPI_Allreduce. Mpi::Environment therefore selects algorithm 3 through MPI's tool
// interface (measured: +5% DDP steps/s on the MLP benchmark, docs/benchmarks.md),
// unless the user chose one (OMPI_MCA_coll_libnbc_iallreduce_algorithm). Other MPI
// libraries have no such control variable and are left alone.
inline void prefer_reduce_scatter_iallreduce() {
  if (std::getenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm") != nullptr) return;
  // Open MPI's MPI_T_init_thread also sets the level MPI_Query_thread reports (and its own
  // "using threads" flag) to the one asked for here: ask for the level MPI_Init_thread gave.
  int level = MPI_THREAD_SINGLE, provided = 0;
  MPI_Query_thread(&level);
  if (MPI_T_init_thread(level, &provided) != MPI_SUCCESS) return;
  int index = -1;
  if (MPI_T_cvar_get_index("coll_libnbc_iallreduce_algorithm", &index) == MPI_SUCCESS) {
    MPI_T_cvar_handle handle{};
    int count = 0;
    if (MPI_T_cvar_handle_alloc(index, nullptr, &handle, &count) == MPI_SUCCESS) {
      const int reduce_scatter_all_gather = 3;
      MPI_T_cvar_write(handle, &reduce_scatter_all_gather);
      MPI_T_cvar_handle_free(&handle);
    }
  }
  MPI_T_finalize();
}

/// The MPI objects a communicator needs beyond MPI's predefined ones. Created when
/// the communicator is made, freed with it (before MPI_Finalize, as MPI requires).
class MpiOps {
 public:
  MpiOps() {
    create<c10::BFloat16>(bf16_);
    create<c10::Half>(f16_);
  }
  ~MpiOps() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (MPI_Op* ops : {bf16_, f16_})
      for (int i = 0; i < 3; ++i) MPI_Op_free(&ops[i]);
  }
  MpiOps(const MpiOps&) = delete;
  MpiOps& operator=(const MpiOps&) = delete;

  [[nodiscard]] static MPI_Datatype datatype(at::ScalarType t) noexcept {
    switch (t) {
      case at::kFloat: return MPI_FLOAT;
      case at::kDouble: return MPI_DOUBLE;
      case at::kInt: return MPI_INT32_T;
      case at::kLong: return MPI_INT64_T;
      default: return MPI_UINT16_T;  // bfloat16, float16: see Note [16-bit reductions]
    }
  }

  /// The operation that reduces `t` with `op`; `average` reduces with the sum.
  [[nodiscard]] MPI_Op op(at::ScalarType t, reduce_op op) const noexcept {
    const int i = op == reduce_op::max ? 1 : op == reduce_op::min ? 2 : 0;
    if (t == at::kBFloat16) return bf16_[i];
    if (t == at::kHalf) return f16_[i];
    return i == 1 ? MPI_MAX : i == 2 ? MPI_MIN : MPI_SUM;
  }

 private:
  template <class T>
  static void create(MPI_Op (&ops)[3]) {
    MPI_Op_create(&combine_16bit<T, plus_f>, /*commute=*/1, &ops[0]);
    MPI_Op_create(&combine_16bit<T, max_f>, 1, &ops[1]);
    MPI_Op_create(&combine_16bit<T, min_f>, 1, &ops[2]);
  }

  MPI_Op bf16_[3]{};
  MPI_Op f16_[3]{};
};

}  // namespace paratrain::detail
