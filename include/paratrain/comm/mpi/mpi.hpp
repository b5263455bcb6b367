#pragma once
/// \file
/// comm::Mpi — collectives over MPI (OpenMPI, MPICH, ...) on CPU tensors.

#include <ATen/core/Tensor.h>
#include <boost/mpi/communicator.hpp>
#include <boost/mpi/environment.hpp>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/reliability/collective_signature.hpp"
#include "paratrain/comm/mpi/detail/requests.hpp"
#include "paratrain/comm/mpi/detail/types.hpp"
#include "paratrain/comm/mpi/environment.hpp"
#include "paratrain/comm/mpi/progress.hpp"
#include "paratrain/comm/mpi/watchdog.hpp"
#include "paratrain/comm/detail/skeleton.hpp"
#include "paratrain/comm/detail/tensor_checks.hpp"
#include "paratrain/reliability/watchdog.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/reliability/failure.hpp"
#include "paratrain/comm/launch.hpp"

namespace paratrain::comm {

// Note [Segmented all-reduce]
// One MPI_Allreduce of a large buffer is slow with OpenMPI 4.1 on one node: 2.4 GB/s
// bus bandwidth at 64 MiB against 7.7 GB/s at 16 MiB (2 ranks, measured): past some
// size its algorithms stream the whole buffer through memory once per phase, while a
// segment that fits in cache is reduced while it is still there. Buffers above
// Options::segment_above_bytes are therefore reduced as consecutive segments of
// Options::segment_bytes (about 2x raw at 64 MiB); smaller ones take exactly the one
// MPI_Allreduce a raw call would, so they are never slower. docs/benchmarks.md has the
// sweep that chose both numbers.

/// A group of MPI processes: `MPI_COMM_WORLD`, or a part of it made with `split`.
///
/// Every operation works in place on contiguous CPU tensors of float32, float64,
/// bfloat16, float16, int32 or int64, and comes blocking (`all_reduce`) and
/// non-blocking (`iall_reduce`, returning a Request with `wait()`/`test()`).
/// The communicator is a duplicate of the group it was made from, so its traffic
/// never matches a message of the application's own MPI calls. Copies of an `Mpi`
/// share that duplicate; `duplicate()` gives an independent one (for a
/// communication thread, say).
///
/// \code
///   paratrain::comm::Mpi::Environment env(argc, argv);
///   paratrain::comm::Mpi world;
///   auto g = torch::ones({4});
///   world.all_reduce(g, paratrain::reduce_op::average);
/// \endcode
class Mpi {
 public:
  struct Options {
    /// All-reduces of more than `segment_above_bytes` are done in segments of
    /// `segment_bytes`: Note [Segmented all-reduce]. Smaller ones take one MPI call.
    std::size_t segment_above_bytes = std::size_t{16} << 20;
    std::size_t segment_bytes = std::size_t{2} << 20;
    /// Reduce-scatters whose `in` has more than `reduce_scatter_segment_above_bytes`,
    /// and all-gathers whose `out` has more than `all_gather_segment_above_bytes` (by
    /// default never: it did not pay here), are done as column segments of
    /// `sharding_segment_bytes` (all ranks' pieces together), at most `sharding_window`
    /// in flight: Note [Segmented reduce-scatter and all-gather]. Every rank must use
    /// the same values.
    std::size_t reduce_scatter_segment_above_bytes = std::size_t{8} << 20;
    std::size_t all_gather_segment_above_bytes = SIZE_MAX;
    std::size_t sharding_segment_bytes = std::size_t{2} << 20;
    int sharding_window = 2;
    /// Before each collective, check that every rank calls the same operation with the
    /// same dtype, element count and root, and throw on every rank if not (instead of a
    /// hang or a silently wrong result). Costs one small all-reduce per collective.
    /// On by default when the environment has PARATRAIN_VALIDATE=1.
    bool validate = detail::env_flag("PARATRAIN_VALIDATE");
    /// How long any one operation may stay pending before the watchdog reports it and ends
    /// the job: Note [Watchdog]. By default PARATRAIN_TIMEOUT (seconds), else 10 minutes.
    std::chrono::milliseconds timeout = detail::default_timeout();
    /// While a non-blocking operation is pending, a thread of the process calls into MPI
    /// this often, so that Open MPI moves it on while the caller computes: Note [Progress
    /// thread]. By default PARATRAIN_MPI_PROGRESS_US, else 0: no thread (measured, it did
    /// not pay where every core computes).
    std::chrono::microseconds progress = detail::default_progress();
  };

  using Environment = MpiEnvironment;  // comm/mpi/environment.hpp
  using Segments = detail::MpiSegments;  // comm/mpi/detail/requests.hpp
  using Handles = detail::MpiHandles;

  /// A pending non-blocking operation: wait() blocks until it is complete, test() makes
  /// progress (MPI progresses only inside its calls) and says whether it is. Dropping one
  /// waits for it: Note [Dropped requests].
  using Request = detail::BasicRequest<Handles>;

  /// A duplicate of MPI_COMM_WORLD; starts MPI where it is not running (Note [MPI started
  /// by the library]). Throws where MPI was finalised, or where a torchrun-style launcher
  /// started the ranks: Note [Launched without MPI].
  Mpi() : Mpi(Options{}) {}
  explicit Mpi(Options options) : Mpi(world(), options) {
    check_launcher();
    // Collective over the world, and done by every rank's first world communicator alike.
    if (!detail::Watchdog::instance().has_channel())
      detail::Watchdog::instance().set_channel(std::make_unique<detail::MpiWatchdogChannel>());
  }

  /// A duplicate of `base`.
  explicit Mpi(const boost::mpi::communicator& base) : Mpi(base, Options{}) {}
  Mpi(const boost::mpi::communicator& base, Options options)
      : state_(std::make_shared<State>(boost::mpi::communicator(base, boost::mpi::comm_duplicate), options,
                                       base == boost::mpi::communicator() ? "world" : "a duplicate")) {}

  [[nodiscard]] int rank() const noexcept { return state_->skeleton.rank(); }
  [[nodiscard]] int size() const noexcept { return state_->skeleton.size(); }
  [[nodiscard]] const Options& options() const noexcept { return state_->options; }
  [[nodiscard]] MPI_Comm native() const noexcept { return state_->native(); }
  [[nodiscard]] const boost::mpi::communicator& boost() const noexcept { return state_->comm; }

  /// An independent communicator over the same ranks.
  [[nodiscard]] Mpi duplicate() const {
    start_pending_segments();
    const auto watch = skeleton().collective("split");
    return Mpi(std::make_shared<State>(boost::mpi::communicator(state_->comm, boost::mpi::comm_duplicate),
                                       state_->options, "a duplicate of " + skeleton().watched().ledger().name()));
  }

  /// The ranks that pass the same `color`, ordered by `key` (then by rank).
  /// Collective: every rank of this communicator must call it.
  [[nodiscard]] Mpi split(int color, int key = 0) const {
    if (color < 0) skeleton().fail("split", "color must be >= 0 (got " + std::to_string(color) + ")");
    start_pending_segments();
    const auto watch = skeleton().collective("split");
    return Mpi(std::make_shared<State>(state_->comm.split(color, key), state_->options,
                                       "split " + std::to_string(color) + " of " + skeleton().watched().ledger().name()));
  }

  void all_reduce(at::Tensor& t, reduce_op op) {
    const auto watch = prepare_reduction("all_reduce", t, op);
    const auto seg = segment_elements(t);
    auto* p = static_cast<char*>(t.data_ptr());
    for (std::int64_t off = 0; off < t.numel(); off += seg)
      check(MPI_Allreduce(MPI_IN_PLACE, p + off * t.element_size(), static_cast<int>(std::min(seg, t.numel() - off)),
                          datatype(t), state_->ops.op(t.scalar_type(), op), native()),
            "all_reduce");
    if (op == reduce_op::average) t.div_(size());
  }

  [[nodiscard]] Request iall_reduce(at::Tensor& t, reduce_op op) {
    auto watch = prepare_reduction("iall_reduce", t, op);
    auto r = request("iall_reduce", {t});
    r.watch_ = std::move(watch);
    const auto seg = segment_elements(t);
    auto* p = static_cast<char*>(t.data_ptr());
    for (std::int64_t off = 0; off < t.numel(); off += seg)
      check(MPI_Iallreduce(MPI_IN_PLACE, p + off * t.element_size(), static_cast<int>(std::min(seg, t.numel() - off)),
                           datatype(t), state_->ops.op(t.scalar_type(), op), native(), r.native_.add()),
            "iall_reduce");
    if (op == reduce_op::average) r.then_ = [t, n = size()]() mutable { t.div_(n); };
    return r;
  }

  void broadcast(at::Tensor& t, int root) { ibroadcast(t, root).wait(); }

  [[nodiscard]] Request ibroadcast(at::Tensor& t, int root) {
    detail::check_buffer("broadcast", rank(), t);
    check_on_host("broadcast", t);
    skeleton().check_peer("broadcast", root);
    auto r = request("broadcast", {t});
    r.watch_ = begin("broadcast", t, root);
    check(MPI_Ibcast(t.data_ptr(), count("broadcast", t), datatype(t), root, native(), r.native_.add()),
          "broadcast");
    return r;
  }

  /// Reduces `in` (size() equal parts, one per rank) and leaves part rank() in `out`.
  /// Large buffers go in segments: Note [Segmented reduce-scatter and all-gather].
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) {
    auto watch = prepare_reduce_scatter(in, out, op);
    if (reduce_scatter_segment(in) < out.numel()) {
      start_reduce_scatter(in, out, op, std::move(watch)).wait();
      return;
    }
    check(MPI_Reduce_scatter_block(in.data_ptr(), out.data_ptr(), count("reduce_scatter", out), datatype(in),
                                   state_->ops.op(in.scalar_type(), op), native()),
          "reduce_scatter");
    if (op == reduce_op::average) out.div_(size());
  }

  [[nodiscard]] Request ireduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) {
    auto watch = prepare_reduce_scatter(in, out, op);
    return start_reduce_scatter(in, out, op, std::move(watch));
  }

  /// Concatenates every rank's `in`, in rank order, into `out` on every rank. In place
  /// when `in` is part rank() of `out` (a view of it, as `out.narrow(0, rank() * n, n)`
  /// is): this rank's part is then not copied. Large buffers go in segments:
  /// Note [Segmented reduce-scatter and all-gather].
  void all_gather(const at::Tensor& in, at::Tensor& out) {
    auto [in_place, watch] = prepare_all_gather(in, out);
    if (all_gather_segment(out) < in.numel()) {
      start_all_gather(in, out, in_place, std::move(watch)).wait();
      return;
    }
    check(MPI_Allgather(in_place ? MPI_IN_PLACE : in.data_ptr(), count("all_gather", in), datatype(in),
                        out.data_ptr(), count("all_gather", in), datatype(in), native()),
          "all_gather");
  }

  [[nodiscard]] Request iall_gather(const at::Tensor& in, at::Tensor& out) {
    auto [in_place, watch] = prepare_all_gather(in, out);
    return start_all_gather(in, out, in_place, std::move(watch));
  }

  /// Part i of `in` (size() equal parts) goes to rank i; part i of `out`, as large as `in`,
  /// is what rank i sent this rank. One MPI_Alltoall.
  void all_to_all(const at::Tensor& in, at::Tensor& out) { all_to_all(in, {}, out, {}); }
  /// The uneven form: `in_counts[i]` elements of `in` go to rank i and `out_counts[i]`
  /// elements of `out` come from rank i, each side's parts consecutive in rank order. What
  /// rank i sends rank j is what rank j expects from rank i: checked on every rank under
  /// validation (Note [All-to-all across ranks]). One MPI_Alltoallv.
  void all_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                  std::span<const std::int64_t> out_counts) {
    const auto layout = all_to_all_layout(in, in_counts, out, out_counts);
    const auto watch = begin_all_to_all(layout);
    const auto type = detail::MpiOps::datatype(layout.dtype);
    if (layout.equal()) {
      const int part = static_cast<int>(layout.part);
      check(MPI_Alltoall(layout.in_data, part, type, layout.out_data, part, type, native()), "all_to_all");
      return;
    }
    // no allocation a call: this rank's one blocking call at a time uses it; rewritten only
    // where the counts changed since the last call (Note [Stores in the preamble])
    auto& l = state_->layout;
    if (!same_counts(layout, l)) int_layout(layout, l);
    const auto n = size();
    check(MPI_Alltoallv(layout.in_data, l.data(), l.data() + n, type, layout.out_data, l.data() + 2 * n, l.data() + 3 * n,
                        type, native()),
          "all_to_all");
  }
  [[nodiscard]] Request iall_to_all(const at::Tensor& in, at::Tensor& out) { return iall_to_all(in, {}, out, {}); }
  /// Non-blocking: Note [Non-blocking all-to-all as messages].
  [[nodiscard]] Request iall_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                                    std::span<const std::int64_t> out_counts) {
    const auto layout = all_to_all_layout(in, in_counts, out, out_counts);
    auto r = request("all_to_all", {in, out});
    r.watch_ = begin_all_to_all(layout);
    post_all_to_all(layout, r.native_);
    return r;
  }

  void send(const at::Tensor& t, int peer, int tag = 0) { isend(t, peer, tag).wait(); }

  /// Receives a message of exactly t.numel() elements. A message of another length
  /// is still taken off the wire (so the sender completes) and then reported: MPI
  /// itself would accept a shorter one silently.
  void recv(at::Tensor& t, int peer, int tag = 0) {
    detail::check_buffer("recv", rank(), t);
    check_on_host("recv", t);
    skeleton().check_peer("recv", peer);
    const auto watch = skeleton().point_to_point("recv", peer, tag);
    MPI_Message message{};
    MPI_Status status{};
    check(MPI_Mprobe(peer, tag, native(), &message, &status), "recv");
    int bytes = 0;
    MPI_Get_count(&status, MPI_BYTE, &bytes);
    const auto expected = t.numel() * t.element_size();
    if (bytes != expected) {
      std::vector<char> discard(static_cast<std::size_t>(bytes));
      check(MPI_Mrecv(discard.data(), bytes, MPI_BYTE, &message, MPI_STATUS_IGNORE), "recv");
      skeleton().fail("recv", "rank " + std::to_string(peer) + " sent " + std::to_string(bytes) + " bytes (tag " +
                       std::to_string(tag) + ") but the receiving tensor holds " + std::to_string(expected) +
                       "; give both sides the same shape and dtype");
    }
    check(MPI_Mrecv(t.data_ptr(), count("recv", t), datatype(t), &message, MPI_STATUS_IGNORE), "recv");
  }

  [[nodiscard]] Request isend(const at::Tensor& t, int peer, int tag = 0) {
    detail::check_buffer("send", rank(), t);
    check_on_host("send", t);
    skeleton().check_peer("send", peer);
    auto r = request("send", {t});
    r.watch_ = skeleton().point_to_point("send", peer, tag);
    check(MPI_Isend(t.data_ptr(), count("send", t), datatype(t), peer, tag, native(), r.native_.add()),
          "send");
    return r;
  }

  /// Receives at most t.numel() elements; a longer message fails the request
  /// (MPI_ERR_TRUNCATE). The blocking recv also rejects a shorter one.
  [[nodiscard]] Request irecv(at::Tensor& t, int peer, int tag = 0) {
    detail::check_buffer("recv", rank(), t);
    check_on_host("recv", t);
    skeleton().check_peer("recv", peer);
    auto r = request("recv", {t});
    r.watch_ = skeleton().point_to_point("recv", peer, tag);
    check(MPI_Irecv(t.data_ptr(), count("recv", t), datatype(t), peer, tag, native(), r.native_.add()),
          "recv");
    return r;
  }

  void barrier() {
    start_pending_segments();
    const auto watch = skeleton().collective("barrier");
    check(MPI_Barrier(native()), "barrier");
  }

 private:
  struct State {
    State(boost::mpi::communicator c, Options o, std::string name)
        : comm(std::move(c)), comm_handle(static_cast<MPI_Comm>(comm)), options(o) {
      // Errors come back as codes that we turn into paratrain::error, rather than
      // aborting the job from inside MPI.
      MPI_Comm_set_errhandler(native(), MPI_ERRORS_RETURN);
      skeleton = detail::Skeleton(comm.rank(), comm.size(), options.validate,
                                  detail::Watched(std::move(name), detail::world_ranks(native()), comm.rank(),
                                                  options.timeout));
    }
    [[nodiscard]] MPI_Comm native() const noexcept { return comm_handle; }

    boost::mpi::communicator comm;
    // comm's handle, read once: Boost's conversion is a call into libboost_mpi on every
    // collective, where it was ~2% of a 4 KiB all-to-all's time (docs/benchmarks.md).
    MPI_Comm comm_handle;
    detail::MpiOps ops;
    Options options;
    std::weak_ptr<Segments> pending;  // Note [Segment order]
    detail::Skeleton skeleton;        // rank, size; Note [Watchdog], Note [Collective fingerprint]
    std::vector<int> layout;          // a blocking all-to-all's counts and displacements, reused
    // The non-blocking all-to-alls' messages: Note [Non-blocking all-to-all as messages].
    std::optional<boost::mpi::communicator> exchange;
    MPI_Comm exchange_handle = MPI_COMM_NULL;
  };

  explicit Mpi(std::shared_ptr<State> s) : state_(std::move(s)) {}

  static boost::mpi::communicator world() {
    detail::start_mpi_if_needed();  // Note [MPI started by the library]
    return boost::mpi::communicator();  // MPI_COMM_WORLD, attached
  }

  // Note [Launched without MPI]
  // Processes started by torchrun (or by hand with RANK/WORLD_SIZE) each initialise MPI
  // as a world of one. Each would then train alone, silently; so a world of one under
  // WORLD_SIZE > 1 is an error that says how to launch instead.
  void check_launcher() const {
    const char* world = std::getenv("WORLD_SIZE");
    if (size() == 1 && world != nullptr && std::atoi(world) > 1)
      skeleton().fail("comm::Mpi", "WORLD_SIZE=" + std::string(world) +
                            " says this process is one of several, but MPI sees a world of 1: the ranks were not "
                            "started by mpirun or srun. Start them with `mpirun -n " + std::string(world) +
                            "` (or srun), or use comm::Gloo, which meets at MASTER_ADDR:MASTER_PORT");
  }

  // MPI is given host pointers: a GPU tensor's would be read as host memory (a CUDA-aware
  // MPI could take it, but nothing tells which MPI this is).
  // An undefined tensor passes, for check_buffer to name (it has no device to name here).
  void check_on_host(const char* op, const at::Tensor& t) const {
    if (!t.is_cpu() && t.defined())
      detail::fail_with(op, rank(), [&] {
        return "comm::Mpi takes CPU tensors; this one is on " + t.device().str() +
               " (use comm::Nccl for GPU tensors, or comm::Gloo, which copies them through the host)";
      });
  }

  static void check(int rc, const char* op, int rank) { detail::mpi_check(rc, op, rank); }
  // A collective that MPI finds truncated (a rank sent more than this one takes) can only
  // have met another collective, or the same with another size: the ranks issued different
  // collectives. Said so, with this rank's side from the ledger (Note [Collective
  // fingerprint]), rather than as MPI's error code alone.
  void check(int rc, const char* op) const {
    if (rc != MPI_SUCCESS) [[unlikely]] fail_check(rc, op);
  }
  // check()'s rare part, out of line: its frame (a ledger's history) cost every call
  // seven stores when it was inline (Note [Stores in the preamble]).
  [[gnu::cold, gnu::noinline]] void fail_check(int rc, const char* op) const {
    int cls = MPI_SUCCESS;
    MPI_Error_class(rc, &cls);
    const std::string_view name(op);
    if (cls == MPI_ERR_TRUNCATE && name != "send" && name != "recv") {
      const auto history = skeleton().watched().ledger().history();
      const auto last = std::find_if(history.rbegin(), history.rend(), [](const auto& r) { return r.seq != 0; });
      throw error(op, rank(),
                  "the ranks issued different collectives on communicator " + skeleton().watched().ledger().name() +
                      ": this rank's " +
                      (last != history.rend() ? detail::describe_operation(*last) : std::string("collective")) +
                      " met one that sends more (MPI: message truncated); every rank must issue the same "
                      "collectives in the same order");
    }
    check(rc, op, rank());
  }

  [[nodiscard]] const detail::Skeleton& skeleton() const noexcept { return state_->skeleton; }

  // The skeleton's word collectives (comm/detail/skeleton.hpp): plain MPI calls.
  struct Words {
    const Mpi& comm;
    void all_reduce_max(const char* op, at::Tensor& w) const {
      comm.check(MPI_Allreduce(MPI_IN_PLACE, w.data_ptr(), comm.count(op, w), MPI_INT64_T, MPI_MAX, comm.native()), op);
    }
    void all_gather(const char* op, const at::Tensor& in, at::Tensor& out) const {
      comm.check(MPI_Allgather(in.data_ptr(), comm.count(op, in), MPI_INT64_T, out.data_ptr(), comm.count(op, in),
                               MPI_INT64_T, comm.native()),
                 op);
    }
  };

  int count(const char* op, const at::Tensor& t) const {
    if (t.numel() > INT_MAX)
      skeleton().fail(op, "tensor has " + std::to_string(t.numel()) + " elements; MPI counts stop at 2^31-1, so split it");
    return static_cast<int>(t.numel());
  }

  static MPI_Datatype datatype(const at::Tensor& t) noexcept { return detail::MpiOps::datatype(t.scalar_type()); }

  std::int64_t segment_elements(const at::Tensor& t) const noexcept {
    const auto bytes = static_cast<std::size_t>(t.numel() * t.element_size());
    if (bytes <= options().segment_above_bytes) return std::clamp<std::int64_t>(t.numel(), 1, INT_MAX);
    const auto per = static_cast<std::int64_t>(options().segment_bytes) / t.element_size();
    return std::clamp<std::int64_t>(per, 1, INT_MAX);
  }

  [[nodiscard]] detail::Watch prepare_reduction(const char* op, at::Tensor& t, reduce_op r) {
    detail::check_reduction(op, rank(), t, r);
    check_on_host(op, t);
    return begin(op, t, static_cast<int>(r));
  }

  // Every collective but barrier, split and duplicate passes here first, which is where
  // the pending segments must start: Note [Segment order]. Then the skeleton's preamble:
  // validation, ledger, fingerprint and watch (comm/detail/skeleton.hpp).
  [[nodiscard]] detail::Watch begin(std::string_view op, const at::Tensor& t, int detail) {
    start_pending_segments();
    return skeleton().begin(op, t, detail, Words{*this});
  }

  // Starts the segments an earlier request left pending: Note [Segment order].
  void start_pending_segments() const {
    if (state_->pending.expired()) return;  // most calls: no store, no atomic operation
    if (auto segments = std::exchange(state_->pending, {}).lock()) segments->start_all("segments", rank());
  }

  /// Elements per rank in one segment of a reduce-scatter or all-gather whose whole
  /// buffer is `whole`; INT64_MAX when it goes in one call.
  std::int64_t sharding_segment(const at::Tensor& whole, std::size_t above) const noexcept {
    if (static_cast<std::size_t>(whole.numel() * whole.element_size()) <= above) return INT64_MAX;
    const auto per = static_cast<std::int64_t>(options().sharding_segment_bytes) / whole.element_size() / size();
    return std::clamp<std::int64_t>(per, 1, INT_MAX);
  }
  std::int64_t reduce_scatter_segment(const at::Tensor& in) const noexcept {
    return sharding_segment(in, options().reduce_scatter_segment_above_bytes);
  }
  std::int64_t all_gather_segment(const at::Tensor& out) const noexcept {
    return sharding_segment(out, options().all_gather_segment_above_bytes);
  }

  [[nodiscard]] detail::Watch prepare_reduce_scatter(const at::Tensor& in, const at::Tensor& out, reduce_op op) {
    detail::check_reduce_scatter(rank(), size(), in, out, op);
    check_on_host("reduce_scatter", in);
    check_on_host("reduce_scatter", out);
    return begin("reduce_scatter", in, static_cast<int>(op));
  }

  /// Checks the arguments and says whether the gather is in place; and its watch.
  std::pair<bool, detail::Watch> prepare_all_gather(const at::Tensor& in, const at::Tensor& out) {
    detail::check_all_gather(rank(), size(), in, out);
    check_on_host("all_gather", in);
    check_on_host("all_gather", out);
    const auto bytes = in.numel() * in.element_size();
    const auto* first = static_cast<const char*>(in.data_ptr());
    const auto* whole = static_cast<const char*>(out.data_ptr());
    const bool in_place = bytes > 0 && first == whole + rank() * bytes;
    if (bytes > 0 && !in_place && first < whole + size() * bytes && whole < first + bytes)
      skeleton().fail("all_gather", "in overlaps out but is not part rank() of it; pass `out.narrow(0, rank() * n, n)` to "
                         "gather in place, or a separate tensor");
    return {in_place, begin("all_gather", in, 0)};
  }

  // An all-to-all's arguments checked (MPI's counts are ints), and their layout, made in
  // place in the caller's frame: returned with the watch as a pair, it was copied, and read
  // back in 16-byte loads that waited on the 8-byte stores that wrote it.
  detail::AllToAllLayout all_to_all_layout(const at::Tensor& in, const std::span<const std::int64_t>& in_counts,
                                           const at::Tensor& out, const std::span<const std::int64_t>& out_counts) const {
    check_on_host("all_to_all", in);  // first: inline reads of what check_all_to_all reads, before its calls
    check_on_host("all_to_all", out);
    return detail::check_all_to_all(rank(), size(), in, in_counts, out, out_counts, INT_MAX);
  }
  [[nodiscard]] detail::Watch begin_all_to_all(const detail::AllToAllLayout& layout) const {
    start_pending_segments();
    return skeleton().begin_all_to_all("all_to_all", layout.dtype, layout, Words{*this});
  }

  // Whether `ints` (int_layout's) already hold the layout's counts: then its offsets too.
  bool same_counts(const detail::AllToAllLayout& l, const std::vector<int>& ints) const noexcept {
    const auto n = static_cast<std::size_t>(size());
    if (ints.size() != 4 * n) return false;
    bool same = true;
    for (std::size_t i = 0; i < n; ++i) same &= ints[i] == l.in_counts[i] && ints[2 * n + i] == l.out_counts[i];
    return same;
  }

  // MPI's int counts and displacements of an all-to-all: in_counts, in_offsets, out_counts,
  // out_offsets, size() each (fit in int: all_to_all_layout checked the sizes), into `ints`.
  void int_layout(const detail::AllToAllLayout& l, std::vector<int>& ints) const {
    const auto n = static_cast<std::size_t>(size());
    ints.resize(4 * n);
    int sent = 0, received = 0;
    for (std::size_t i = 0; i < n; ++i) {
      ints[i] = static_cast<int>(l.in_count(i));
      ints[n + i] = sent;
      ints[2 * n + i] = static_cast<int>(l.out_count(i));
      ints[3 * n + i] = received;
      sent += ints[i], received += ints[2 * n + i];
    }
  }

  // Note [Non-blocking all-to-all as messages]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // iall_to_all posts its exchange as point-to-point messages: this rank's own part copied,
  // a receive from every other rank into its part of `out`, then a send of every other rank's
  // part of `in`; the request waits for them in that order. Open MPI 4.1's MPI_Ialltoallv
  // (libnbc) posts the same messages, through a schedule it allocates, fills and frees on
  // every call, which made it slower than the blocking MPI_Alltoallv at small sizes (~0.83
  // against ~0.6 us at 4 KiB on 2 ranks here) and made paratrain's own ~140 ns a call (checks,
  // watch, request) show: 0.84x raw MPI_Ialltoallv at 4 KiB. Posted directly, the messages
  // took 0.8-0.9x its time at 4 KiB on 2, 3 and 4 ranks, and as long from 1 MiB; iall_to_all
  // now runs 1.25x as fast as raw MPI_Ialltoallv at 4 KiB in this VM's fast state (as fast in
  // its slow one), 1.02-1.06x to 512 KiB and 1.00-1.01x above (docs/benchmarks.md). The
  // blocking forms stay one MPI_Alltoall(v): the same messages waited for at once were no
  // faster than those.
  // The messages go on a communicator of their own, a duplicate made by the first non-blocking
  // all-to-all (collective like it: every rank makes it at the same point), with one tag: they
  // never match the application's send/recv on this communicator, and MPI's non-overtaking
  // rule matches successive all-to-alls' messages in order. Every message is posted, empty
  // ones too: had a rank skipped an empty part that its peer expected not empty, the peer's
  // receive would match the next all-to-all's message. A peer that sends more than this rank
  // expects fails the wait, named (mpi_wait_failed); one that sends less is not seen (nor is it
  // by MPI_Ialltoallv): PARATRAIN_VALIDATE=1 compares every pair's counts before anything is
  // sent (Note [All-to-all across ranks]).
  void post_all_to_all(const detail::AllToAllLayout& l, Handles& h) {
    const MPI_Comm c = exchange();  // first: every rank makes it, even one that fails below
    const auto n = static_cast<std::size_t>(size()), me = static_cast<std::size_t>(rank());
    if (l.in_count(me) != l.out_count(me)) [[unlikely]]
      skeleton().fail("all_to_all", "this rank sends itself " + std::to_string(l.in_count(me)) +
                                        " elements (in_counts[" + std::to_string(me) + "]) but expects " +
                                        std::to_string(l.out_count(me)) + " from itself (out_counts[" +
                                        std::to_string(me) + "]); give both the same count");
    const auto type = detail::MpiOps::datatype(l.dtype);
    const auto bytes = static_cast<std::int64_t>(c10::elementSize(l.dtype));
    auto* const out = static_cast<char*>(l.out_data);
    const auto* const in = static_cast<const char*>(l.in_data);
    // This rank's own part first, in pieces of 64 KiB: copied after the messages were posted,
    // or in one memcpy (whose non-temporal stores glibc uses for large copies), a 128-256 MiB
    // all-to-all took 5-9% longer than MPI_Ialltoallv, whose copy goes in pieces too.
    std::int64_t own_in = 0, own_out = 0;
    for (std::size_t i = 0; i < me; ++i) own_in += l.in_count(i), own_out += l.out_count(i);
    const auto own = static_cast<std::size_t>(l.in_count(me) * bytes);
    constexpr std::size_t piece = std::size_t{64} << 10;
    for (std::size_t from = 0; from < own; from += piece)
      std::memcpy(out + own_out * bytes + from, in + own_in * bytes + from, std::min(piece, own - from));
    std::int64_t at = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const auto k = l.out_count(i);
      if (i != me)
        check(MPI_Irecv(out + at * bytes, static_cast<int>(k), type, static_cast<int>(i), 0, c, h.add()), "all_to_all");
      at += k;
    }
    at = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const auto k = l.in_count(i);
      if (i != me)
        check(MPI_Isend(in + at * bytes, static_cast<int>(k), type, static_cast<int>(i), 0, c, h.add()), "all_to_all");
      at += k;
    }
  }
  // The communicator of the non-blocking all-to-alls' messages, duplicated at the first one.
  MPI_Comm exchange() {
    if (state_->exchange_handle != MPI_COMM_NULL) [[likely]]
      return state_->exchange_handle;
    state_->exchange.emplace(state_->comm, boost::mpi::comm_duplicate);
    state_->exchange_handle = static_cast<MPI_Comm>(*state_->exchange);
    MPI_Comm_set_errhandler(state_->exchange_handle, MPI_ERRORS_RETURN);
    return state_->exchange_handle;
  }

  Request start_reduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op, detail::Watch watch) {
    auto r = request("reduce_scatter", {in, out});
    r.watch_ = std::move(watch);
    const auto type = datatype(in);
    const auto mpi_op = state_->ops.op(in.scalar_type(), op);
    if (op == reduce_op::average) r.then_ = [out, n = size()]() mutable { out.div_(n); };
    const auto part = out.numel(), seg = reduce_scatter_segment(in);
    if (seg >= part) {
      check(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), count("reduce_scatter", out), type, mpi_op,
                                      native(), r.native_.add()),
            "reduce_scatter");
      return r;
    }
    // Each segment packs its size() strided pieces of `in` into scratch, then reduces
    // them into its place in `out`.
    const auto window = static_cast<std::size_t>(std::max(1, options().sharding_window));
    r.native_.segments = std::make_shared<Segments>();
    r.native_.segments->count = (part + seg - 1) / seg;
    r.native_.segments->window = window;
    r.native_.segments->start = [state = state_, in, out, part, seg, type, mpi_op,
                          slots = std::vector<std::vector<char>>(window),
                          extra = std::vector<std::vector<char>>()](std::int64_t k, MPI_Request* request,
                                                                      bool reuse) mutable {
      const auto size = static_cast<std::size_t>(in.element_size());
      const auto from = k * seg, m = std::min(seg, part - from);
      auto& scratch = reuse ? slots[static_cast<std::size_t>(k) % slots.size()] : extra.emplace_back();
      scratch.resize(static_cast<std::size_t>(state->skeleton.size() * m) * size);
      const auto* source = static_cast<const char*>(in.data_ptr());
      for (int i = 0; i < state->skeleton.size(); ++i)
        std::memcpy(scratch.data() + static_cast<std::size_t>(i * m) * size,
                    source + static_cast<std::size_t>(i * part + from) * size, static_cast<std::size_t>(m) * size);
      return MPI_Ireduce_scatter_block(scratch.data(), static_cast<char*>(out.data_ptr()) + from * in.element_size(),
                                       static_cast<int>(m), type, mpi_op, state->native(), request);
    };
    r.native_.segments->start_some("reduce_scatter", rank());
    state_->pending = r.native_.segments;
    return r;
  }

  Request start_all_gather(const at::Tensor& in, at::Tensor& out, bool in_place, detail::Watch watch) {
    auto r = request("all_gather", {in, out});
    r.watch_ = std::move(watch);
    const auto type = datatype(in);
    const auto part = in.numel(), seg = all_gather_segment(out);
    if (seg >= part) {
      check(MPI_Iallgather(in_place ? MPI_IN_PLACE : in.data_ptr(), count("all_gather", in), type, out.data_ptr(),
                           count("all_gather", in), type, native(), r.native_.add()),
            "all_gather");
      return r;
    }
    // Each segment places every rank's piece at its displacement in `out`, which must
    // therefore be addressable with int displacements.
    (void)count("all_gather", out);
    const auto window = static_cast<std::size_t>(std::max(1, options().sharding_window));
    r.native_.segments = std::make_shared<Segments>();
    r.native_.segments->count = (part + seg - 1) / seg;
    r.native_.segments->window = window;
    r.native_.segments->start = [state = state_, in, out, part, seg, type, in_place,
                          slots = std::vector<std::vector<int>>(window),
                          extra = std::vector<std::vector<int>>()](std::int64_t k, MPI_Request* request,
                                                                     bool reuse) mutable {
      const auto from = k * seg, m = std::min(seg, part - from);
      // Counts, then displacements: MPI reads them until the segment completes.
      auto& layout = reuse ? slots[static_cast<std::size_t>(k) % slots.size()] : extra.emplace_back();
      layout.assign(2 * static_cast<std::size_t>(state->skeleton.size()), static_cast<int>(m));
      for (int i = 0; i < state->skeleton.size(); ++i)
        layout[static_cast<std::size_t>(state->skeleton.size() + i)] = static_cast<int>(i * part + from);
      const void* source = in_place ? MPI_IN_PLACE : static_cast<const char*>(in.data_ptr()) + from * in.element_size();
      return MPI_Iallgatherv(source, static_cast<int>(m), type, out.data_ptr(), layout.data(),
                             layout.data() + state->skeleton.size(), type, state->native(), request);
    };
    r.native_.segments->start_some("all_gather", rank());
    state_->pending = r.native_.segments;
    return r;
  }

  // A pending operation's request, which keeps the progress thread calling MPI until it
  // completes: Note [Progress thread].
  Request request(const char* op, detail::KeptTensors keep) {
    Request r(op, rank(), std::move(keep));
    r.native_.progress = detail::MpiProgress::instance().lease(options().progress);
    return r;
  }

  std::shared_ptr<State> state_;
};

}  // namespace paratrain::comm
