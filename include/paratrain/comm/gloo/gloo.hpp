#pragma once
/// \file
/// comm::Gloo — collectives over LibTorch's own c10d ProcessGroupGloo on CPU tensors, with
/// torchrun's rendezvous (MASTER_ADDR, MASTER_PORT): several processes without MPI.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#ifndef USE_C10D_GLOO
#error "paratrain: comm::Gloo needs LibTorch's c10d built with Gloo (USE_C10D_GLOO, set by LibTorch's torch CMake target); link paratrain::gloo"
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/reliability/collective_signature.hpp"
#include "paratrain/comm/gloo/watchdog.hpp"
#include "paratrain/util/torch_compat.hpp"
#include "paratrain/comm/detail/skeleton.hpp"
#include "paratrain/comm/detail/tensor_checks.hpp"
#include "paratrain/reliability/watchdog.hpp"
#include "paratrain/core/message.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/comm/launch.hpp"
#include "paratrain/comm/peer_loss.hpp"
#include "paratrain/comm/rendezvous.hpp"

namespace paratrain::comm {

// Note [What Gloo lacks in LibTorch 1.13]
// Checked against Debian's libtorch 1.13.1: c10d's ProcessGroupGloo rejects bfloat16 in every
// collective ("Invalid scalar type"), has no ReduceOp::AVG, no reduce_scatter and no
// _allgather_base. So:
// - bfloat16 is reduced in float32 (a converted copy, reduced, rounded back once): no less
//   exact than comm::Mpi's pairwise widening. Broadcast and all-gather move bfloat16 as
//   float16, the same two bytes copied, never computed on (Gloo has no int16 either).
// - average is a sum followed by one division, as in comm::Mpi.
// - reduce_scatter is an all-reduce of a copy of `in` followed by a copy of part rank() into
//   `out`: correct, but each rank receives the whole reduced buffer, about twice the traffic
//   of a ring reduce-scatter, plus one copy of `in`. Use comm::Mpi where that matters.
// - all_gather gathers into views of `out`, one per rank; c10d copies each part there.

// Note [Length header]
// A Gloo receive posted for fewer bytes than arrive aborts the receiving process from Gloo's
// network thread (`op.preamble.length <= op.nbytes`, std::terminate), and a shorter message is
// accepted silently. So every send is preceded by one int64 holding its byte count, on the same
// tag (Gloo delivers one pair's messages of one tag in order). recv checks it first: a message
// of another length is still received into a scratch buffer, so that the sender completes, and
// then reported, exactly as comm::Mpi does. The price is one 8-byte message per send.

/// A group of processes communicating through Gloo (TCP), as PyTorch's `gloo` backend does.
///
/// Ranks meet at `MASTER_ADDR:MASTER_PORT`, where rank 0 runs a c10d TCPStore; rank and world
/// size come from `paratrain::detect_placement()` (torchrun's RANK/WORLD_SIZE, mpirun's, srun's)
/// unless Options names them. So a program that uses it runs under torchrun, under a script
/// that exports those variables (examples/launch/torchrun_style.sh), or under mpirun/srun with
/// MASTER_ADDR and MASTER_PORT exported, and needs no MPI library. Ranks that share a file
/// system may meet in a file instead (PARATRAIN_STORE_FILE: comm::Rendezvous). A world of one
/// needs no rendezvous at all.
///
/// Every operation works in place on contiguous tensors of float32, float64, bfloat16,
/// float16, int32 or int64, with comm::Mpi's checks and messages: CPU tensors, and CUDA ones
/// where LibTorch has CUDA (collectives through c10d's own host staging, sends and receives
/// through a host copy here), so that processes sharing one GPU can train over it; Note [What Gloo lacks in
/// LibTorch 1.13] says what is emulated. Operations run on Gloo's own threads, so an
/// `iall_reduce` progresses while the caller computes. Copies of a `Gloo` share one process
/// group; `duplicate()` and `split()` make new ones.
///
/// \code
///   paratrain::comm::Gloo world;  // RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
///   auto g = torch::ones({4});
///   world.all_reduce(g, paratrain::reduce_op::average);
/// \endcode
///
/// Choose it for: CPU ranks without MPI (a laptop, a container, torchrun). Choose comm::Mpi
/// where MPI is installed (faster reduce-scatter, no rendezvous port), comm::Nccl for GPUs.
class Gloo {
 public:
  struct Options {
    /// This process's rank; by default `detect_placement().rank`.
    std::optional<int> rank;
    /// The number of ranks; by default `detect_placement().world_size`.
    std::optional<int> world_size;
    /// The host where rank 0 listens for the others; by default the environment's MASTER_ADDR.
    std::optional<std::string> master_addr;
    /// Its port; by default the environment's MASTER_PORT.
    std::optional<int> master_port;
    /// How long to wait for the other ranks: at the rendezvous, and in any one operation,
    /// after which the watchdog reports it and ends the job (Note [Watchdog]); Gloo's own
    /// timeout is set a little later. By default PARATRAIN_TIMEOUT (seconds), else 10 minutes.
    std::chrono::milliseconds timeout = detail::default_timeout();
    /// The network interface to connect over (as PyTorch's GLOO_SOCKET_IFNAME, its default).
    /// Empty: loopback when MASTER_ADDR is a loopback address (or the world is one rank), else
    /// the address this host's name resolves to (also for ranks that meet in a file).
    std::string interface = env_string("GLOO_SOCKET_IFNAME");
    /// As comm::Mpi::Options::validate: check that every rank calls the same collective with
    /// the same dtype, element count and root, and throw on every rank if not.
    bool validate = detail::env_flag("PARATRAIN_VALIDATE");
    /// Set by elastic::Membership, whose groups survive a lost rank: a failed or timed-out
    /// operation then throws paratrain::peer_lost on every rank instead of ending the job
    /// (Note [Recoverable groups]). Splits and duplicates share it. Null: the watchdog's way.
    std::shared_ptr<PeerLoss> peer_loss;
  };

  // c10d's handles on one operation, for detail::BasicRequest (comm/detail/request.hpp).
  struct Handles {
    using owner = Gloo;
    // A constructor, not member initialisers: those would make Handles default-constructible
    // only once Gloo is complete, after BasicRequest<Handles> has checked that it is.
    Handles() noexcept : can_poll(true) {}
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    bool can_poll;
    std::shared_ptr<PeerLoss> loss;     // Options::peer_loss
    std::chrono::milliseconds limit{};  // Options::timeout, where `loss` is set

    [[nodiscard]] bool pending() const noexcept { return !works.empty(); }
    void wait(const char* op, int rank) {
      const auto all = std::exchange(works, {});
      for (std::size_t i = 0; i < all.size(); ++i) {
        try {
          if (loss && can_poll) detail::await_work(*all[i], *loss, limit, op, rank);
          else all[i]->wait();
        } catch (...) {
          // What is still pending may run on Gloo's threads: Note [Recoverable groups].
          if (loss) new std::vector<c10::intrusive_ptr<c10d::Work>>(all.begin() + static_cast<std::ptrdiff_t>(i), all.end());
          rethrow_as_error(op, rank, loss.get());
        }
      }
    }
    // Without blocking, for collectives. c10d cannot poll a send or receive, so for those
    // (isend) it waits and returns true.
    [[nodiscard]] bool test(const char* op, int rank) {
      if (can_poll && !std::all_of(works.begin(), works.end(), [](const auto& w) { return w->isCompleted(); }))
        return false;
      wait(op, rank);  // complete: collects a failure
      return true;
    }
    /// Whether test() answers without blocking: true but for sends, which progress on
    /// c10d's threads and which test() must wait for (c10d cannot poll them). Callers need
    /// not, and between two ranks that send to each other must not, test those.
    [[nodiscard]] bool pollable() const noexcept { return can_poll; }
    void abandon() noexcept { new std::vector<c10::intrusive_ptr<c10d::Work>>(std::exchange(works, {})); }
  };

  /// A pending operation: wait() blocks until it is complete and throws paratrain::error
  /// when Gloo failed (a peer died, the timeout passed); test() says whether it is, without
  /// blocking where pollable() (not for sends). Dropping one waits for it, except during
  /// stack unwinding (Note [Dropped requests]).
  using Request = detail::BasicRequest<Handles>;

  /// Joins the group the launcher describes: rank and world size from detect_placement(),
  /// rendezvous at MASTER_ADDR:MASTER_PORT. Collective: blocks until every rank has joined
  /// (at most Options::timeout), and throws paratrain::error naming the variables otherwise.
  Gloo() : Gloo(Options{}) {}
  explicit Gloo(Options options) : state_(join(std::move(options))) {}
  /// The group of `size` ranks that meet in `store`, a c10d store every one of them reaches
  /// (under a prefix of this group's own: the ranks' addresses go there), this one as `rank`;
  /// Options' rank, size and address fields are not used. elastic::Membership makes its
  /// generations so. Collective: blocks until every rank has joined (at most Options::timeout).
  Gloo(c10::intrusive_ptr<c10d::Store> store, int rank, int size, Options options)
      : state_(join_store(std::move(store), rank, size, std::move(options))) {}

  [[nodiscard]] int rank() const noexcept { return state_->skeleton.rank(); }
  [[nodiscard]] int size() const noexcept { return state_->skeleton.size(); }
  [[nodiscard]] const Options& options() const noexcept { return state_->options; }
  /// The c10d process group underneath, for what paratrain does not wrap.
  [[nodiscard]] c10d::ProcessGroupGloo& native() const noexcept { return *state_->group; }

  /// An independent group over the same ranks (for a communication thread, say).
  /// Collective: every rank of this group must call it.
  [[nodiscard]] Gloo duplicate() const { return split(0, rank()); }
  /// The same, with other timeout, interface and validate settings (the rank, size and
  /// address fields of `options` are not used: the new group meets through this one).
  [[nodiscard]] Gloo duplicate(Options options) const { return split_with(0, rank(), std::move(options)); }

  /// The ranks that pass the same `color`, ordered by `key` (then by rank), as a new group
  /// that meets through this one's store. Collective: every rank of this group must call it.
  [[nodiscard]] Gloo split(int color, int key = 0) const { return split_with(color, key, options()); }

  void all_reduce(at::Tensor& t, reduce_op op) { start_all_reduce("all_reduce", t, op).wait(); }
  [[nodiscard]] Request iall_reduce(at::Tensor& t, reduce_op op) { return start_all_reduce("iall_reduce", t, op); }

  void broadcast(at::Tensor& t, int root) { ibroadcast(t, root).wait(); }

  [[nodiscard]] Request ibroadcast(at::Tensor& t, int root) {
    detail::check_buffer("broadcast", rank(), t);
    skeleton().check_peer("broadcast", root);
    auto r = request("broadcast", {t});
    r.watch_ = begin("broadcast", t, root);
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<at::Tensor> v{bits(t)};
    r.native_.works.push_back(run("broadcast", [&] { return group().broadcast(v, o); }));
    return r;
  }

  /// Reduces `in` (size() equal parts, one per rank) and leaves part rank() in `out`.
  /// An all-reduce underneath: Note [What Gloo lacks in LibTorch 1.13].
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) { ireduce_scatter(in, out, op).wait(); }

  [[nodiscard]] Request ireduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) {
    detail::check_reduce_scatter(rank(), size(), in, out, op);
    auto watch = begin("reduce_scatter", in, static_cast<int>(op));
    auto whole = in.reshape({-1}).to(reduced_type(in), /*non_blocking=*/false, /*copy=*/true);
    auto r = request("reduce_scatter", {in, out, whole});
    r.watch_ = std::move(watch);
    std::vector<at::Tensor> v{whole};
    r.native_.works.push_back(run("reduce_scatter", [&] { return group().allreduce(v, all_reduce_options(op)); }));
    const auto part = out.numel();
    r.then_ = [whole, out, part, from = rank() * part, n = size(), average = op == reduce_op::average]() mutable {
      auto mine = whole.narrow(0, from, part);
      if (average) mine.div_(n);
      out.view({-1}).copy_(mine);
    };
    return r;
  }

  /// Concatenates every rank's `in`, in rank order, into `out` on every rank.
  void all_gather(const at::Tensor& in, at::Tensor& out) { iall_gather(in, out).wait(); }

  [[nodiscard]] Request iall_gather(const at::Tensor& in, at::Tensor& out) {
    detail::check_all_gather(rank(), size(), in, out);
    auto r = request("all_gather", {in, out});
    r.watch_ = begin("all_gather", in, 0);
    const auto n = in.numel();
    if (n == 0) return r;  // Gloo's all-gather divides by the size (SIGFPE); every rank has 0 here
    const auto flat = bits(out).view({-1});
    std::vector<std::vector<at::Tensor>> parts(1);
    for (int i = 0; i < size(); ++i) parts[0].push_back(flat.narrow(0, i * n, n));
    std::vector<at::Tensor> v{bits(in).view({-1})};
    r.native_.works.push_back(run("all_gather", [&] { return group().allgather(parts, v); }));
    return r;
  }

  /// Part i of `in` (size() equal parts) goes to rank i; part i of `out`, as large as `in`,
  /// is what rank i sent this rank. The uneven form takes each part's element count, as
  /// comm::Mpi's does (Note [All-to-all across ranks]). c10d's alltoall_base; a GPU tensor
  /// goes through a host copy, as sends do.
  void all_to_all(const at::Tensor& in, at::Tensor& out) { iall_to_all(in, {}, out, {}).wait(); }
  void all_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                  std::span<const std::int64_t> out_counts) {
    iall_to_all(in, in_counts, out, out_counts).wait();
  }
  [[nodiscard]] Request iall_to_all(const at::Tensor& in, at::Tensor& out) { return iall_to_all(in, {}, out, {}); }
  [[nodiscard]] Request iall_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                                    std::span<const std::int64_t> out_counts) {
    auto layout = detail::check_all_to_all(rank(), size(), in, in_counts, out, out_counts);
    auto watch = skeleton().begin_all_to_all("all_to_all", in.scalar_type(), layout, Words{*this});
    // Gloo moves host memory, bfloat16 as float16 (Note [What Gloo lacks in LibTorch 1.13]).
    auto source = bits(in.is_cpu() ? in : in.cpu()).view({-1});
    auto target = out.is_cpu() ? bits(out).view({-1}) : at::empty({out.numel()}, bits(out).options().device(at::kCPU));
    auto r = request("all_to_all", {in, out, source, target});
    r.watch_ = std::move(watch);
    // With counts always: c10d's equal split would check divisibility itself, along dimension 0.
    std::vector<std::int64_t> sends, receives;  // c10d takes them by non-const reference
    for (std::size_t i = 0; i < static_cast<std::size_t>(size()); ++i)
      sends.push_back(layout.in_count(i)), receives.push_back(layout.out_count(i));
    r.native_.works.push_back(run("all_to_all", [&] { return group().alltoall_base(target, source, receives, sends); }));
    if (!out.is_cpu()) r.then_ = [out, target]() mutable { bits(out).view({-1}).copy_(target); };
    return r;
  }

  /// Sends `t` to `peer`; returns once Gloo has handed it over, which may need `peer` to
  /// have posted the matching recv: in a ring, use isend. `tag` must be >= 0.
  void send(const at::Tensor& t, int peer, int tag = 0) { isend(t, peer, tag).wait(); }

  /// A send that completes in the background. Its request's test() waits (c10d cannot
  /// poll a send).
  [[nodiscard]] Request isend(const at::Tensor& t, int peer, int tag = 0) {
    check_point_to_point("send", t, peer, tag);
    auto header = at::empty({1}, at::kLong);
    header.data_ptr<std::int64_t>()[0] = t.numel() * t.element_size();
    // c10d's Gloo sends from host memory only: a GPU tensor goes through a host copy.
    const auto wire = t.is_cpu() ? t : t.cpu();
    auto r = request("send", {wire, header});
    r.watch_ = skeleton().point_to_point("send", peer, tag);
    r.native_.can_poll = false;
    std::vector<at::Tensor> h{header}, payload{wire};
    r.native_.works.push_back(run("send", [&] { return group().send(h, peer, tag); }));
    if (t.numel() > 0) r.native_.works.push_back(run("send", [&] { return group().send(payload, peer, tag); }));
    return r;
  }

  /// Receives a message of exactly t.numel() elements from `peer` with `tag`. A message of
  /// another length is still taken off the wire (so the sender completes) and then reported:
  /// Note [Length header].
  void recv(at::Tensor& t, int peer, int tag = 0) {
    check_point_to_point("recv", t, peer, tag);
    const auto watch = skeleton().point_to_point("recv", peer, tag);
    auto header = at::empty({1}, at::kLong);
    receive(header, peer, tag);
    const auto bytes = header.data_ptr<std::int64_t>()[0];
    const auto expected = t.numel() * t.element_size();
    if (bytes != expected) {
      if (bytes > 0) {
        auto discard = at::empty({bytes}, at::kByte);
        receive(discard, peer, tag);
      }
      skeleton().fail("recv", "rank " + std::to_string(peer) + " sent " + std::to_string(bytes) + " bytes (tag " +
                       std::to_string(tag) + ") but the receiving tensor holds " + std::to_string(expected) +
                       "; give both sides the same shape and dtype");
    }
    if (bytes > 0 && t.is_cpu()) receive(t, peer, tag);
    if (bytes > 0 && !t.is_cpu()) {  // into host memory, as sends: c10d's Gloo receives there only
      auto host = at::empty(t.sizes(), t.options().device(at::kCPU));
      receive(host, peer, tag);
      t.copy_(host);
    }
  }

  void barrier() {
    auto r = request("barrier", {});
    r.watch_ = skeleton().collective("barrier");
    r.native_.works.push_back(run("barrier", [&] { return group().barrier(); }));
    r.wait();
  }

 private:
  struct State {
    State() = default;
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    // A lost generation's group may have work stuck on its threads, which its destructor
    // would join: it is leaked (Note [Recoverable groups]).
    ~State() {
      if (options.peer_loss && options.peer_loss->lost() && group) static_cast<void>(group.release());
    }
    Options options;
    std::string where;                        // "host:port", "file <path>", or "" for a world of one
    std::string host;                         // MASTER_ADDR where the ranks met over TCP, else ""
    c10::intrusive_ptr<c10d::Store> store;    // declared before the group: it outlives it
    c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
    detail::Skeleton skeleton;  // rank, size; Note [Watchdog], Note [Collective fingerprint]
    int splits = 0;  // made so far: names each new group's store prefix, the same on every rank
  };

  explicit Gloo(std::shared_ptr<State> s) : state_(std::move(s)) {}

  static std::string env_string(const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  }

  static bool is_loopback(std::string_view host) {
    return host == "localhost" || host == "::1" || host.substr(0, 4) == "127.";
  }

  // Where this rank listens for the others: Options::interface; loopback for a world of one
  // and for a meeting at a loopback address (every rank on this host); else the address this
  // host's name resolves to, as PyTorch's default. A meeting in a file says nothing about
  // where the ranks are (they may be on several hosts that share the file system), so it
  // takes that default too.
  static std::shared_ptr<::gloo::transport::Device> device(const Options& o, std::string_view host, int size) {
    if (!o.interface.empty()) return c10d::ProcessGroupGloo::createDeviceForInterface(o.interface);
    if (size == 1 || is_loopback(host)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    return c10d::ProcessGroupGloo::createDefaultDevice();
  }

  static c10::intrusive_ptr<c10d::ProcessGroupGloo> make_group(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                              int size, const Options& o, std::string_view host) {
    // Past the watchdog's deadline and its grace, so that the watchdog reports first.
    auto gloo_options = c10d::ProcessGroupGloo::Options::create(o.timeout + std::chrono::seconds(15));
    gloo_options->devices.push_back(device(o, host, size));
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
  }

  static std::shared_ptr<State> join(Options o) {
    auto s = std::make_shared<State>();
    // Where the ranks meet (comm/rendezvous.hpp): MASTER_ADDR:MASTER_PORT, a shared file, or
    // nobody for a world of one.
    const Rendezvous meeting({.rank = o.rank,
                              .world_size = o.world_size,
                              .local_rank = o.rank && o.world_size ? std::optional<int>(0) : std::nullopt,
                              .master_addr = o.master_addr,
                              .master_port = o.master_port,
                              .timeout = o.timeout},
                             "comm::Gloo");
    const int rank = meeting.rank(), size = meeting.size();
    s->where = meeting.where();
    s->host = meeting.host();
    s->store = meeting.store();
    try {
      s->group = make_group(s->store, rank, size, o, meeting.host());
      if (size > 1 && meeting.port() != 0 && !detail::Watchdog::instance().has_channel())
        detail::Watchdog::instance().set_channel(std::make_unique<detail::GlooWatchdogChannel>(
            meeting.host(), static_cast<std::uint16_t>(meeting.port()), rank, size));
    } catch (const error&) {
      throw;
    } catch (const std::exception& e) {
      throw error("comm::Gloo", rank, "joining the group that met at " + s->where + " failed: " +
                                          paratrain::detail::message_of(e));
    }
    s->options = std::move(o);
    s->skeleton = world_skeleton(rank, size, s->options);
    return s;
  }

  static std::shared_ptr<State> join_store(c10::intrusive_ptr<c10d::Store> store, int rank, int size, Options o) {
    if (size < 1 || rank < 0 || rank >= size)
      throw error("comm::Gloo", rank, "rank " + std::to_string(rank) + " is not in a world of " + std::to_string(size));
    auto s = std::make_shared<State>();
    s->where = "a store of the caller's";
    s->store = std::move(store);
    try {
      s->group = make_group(s->store, rank, size, o, "");
    } catch (const std::exception& e) {
      throw error("comm::Gloo", rank, "joining a group of " + std::to_string(size) + " ranks failed: " +
                                          paratrain::detail::message_of(e));
    }
    s->options = std::move(o);
    s->skeleton = world_skeleton(rank, size, s->options);
    return s;
  }

  // The watchdog's limit: a recoverable group's waits give up first (Note [Recoverable groups]).
  static std::chrono::milliseconds watch_limit(const Options& o) {
    return o.peer_loss ? o.timeout + std::chrono::seconds(60) : o.timeout;
  }

  static detail::Skeleton world_skeleton(int rank, int size, const Options& o) {
    std::vector<int> members(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r) members[static_cast<std::size_t>(r)] = r;
    return detail::Skeleton(rank, size, o.validate, detail::Watched("world", std::move(members), rank, watch_limit(o)));
  }

  Gloo split_with(int color, int key, Options o) const {
    if (color < 0) skeleton().fail("split", "color must be >= 0 (got " + std::to_string(color) + ")");
    // Every rank's (color, key), gathered over this group.
    auto mine = at::empty({2}, at::kLong);
    mine.data_ptr<std::int64_t>()[0] = color;
    mine.data_ptr<std::int64_t>()[1] = key;
    auto all = at::empty({2 * size()}, at::kLong);
    Gloo(state_).all_gather(mine, all);
    const auto* v = all.data_ptr<std::int64_t>();
    std::vector<std::pair<std::int64_t, int>> members;  // (key, rank) of the ranks of my colour
    for (int r = 0; r < size(); ++r)
      if (v[2 * r] == color) members.emplace_back(v[2 * r + 1], r);
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), std::pair<std::int64_t, int>{key, rank()});

    auto s = std::make_shared<State>();
    const auto new_rank = static_cast<int>(me - members.begin()), new_size = static_cast<int>(members.size());
    s->where = state_->where;
    s->host = state_->host;
    o.rank = new_rank;
    o.world_size = new_size;
    s->options = std::move(o);
    {
      const auto& parent = skeleton().watched().ledger();
      std::vector<int> world;
      for (const auto& [k, r] : members) world.push_back(parent.members()[static_cast<std::size_t>(r)]);
      s->skeleton = detail::Skeleton(new_rank, new_size, s->options.validate,
                                     detail::Watched("split " + std::to_string(color) + " of " + parent.name(),
                                                     std::move(world), new_rank, watch_limit(s->options)));
    }
    const auto watch = skeleton().collective("split");
    const auto prefix = "paratrain/split/" + std::to_string(state_->splits++) + "/" + std::to_string(color);
    try {
      s->store = c10::make_intrusive<c10d::PrefixStore>(prefix, state_->store);
      s->group = make_group(s->store, new_rank, new_size, s->options, state_->host);
    } catch (...) {
      rethrow_as_error("split", rank());
    }
    return Gloo(std::move(s));
  }

  [[nodiscard]] c10d::ProcessGroupGloo& group() const noexcept { return *state_->group; }

  // A request of this group: with its peer-loss flag where it has one.
  [[nodiscard]] Request request(const char* op, detail::KeptTensors keep) const {
    Request r(op, rank(), std::move(keep));
    r.native_.loss = options().peer_loss;
    r.native_.limit = options().timeout;
    return r;
  }

  // Inside a catch block: the exception in flight, as a paratrain::error of `op`; in a
  // recoverable group, a Gloo failure is a lost peer (Note [Recoverable groups]).
  [[noreturn]] static void rethrow_as_error(const char* op, int rank, PeerLoss* loss = nullptr) {
    try {
      throw;
    } catch (const error&) {
      throw;
    } catch (const std::exception& e) {
      const auto why = "Gloo failed: " + paratrain::detail::message_of(e);
      if (loss == nullptr) throw error(op, rank, why);
      loss->raise(std::string(op) + " on rank " + std::to_string(rank) + ": " + why);
      throw peer_lost(op, rank, why);
    } catch (...) {
      throw error(op, rank, "Gloo failed with an unknown exception");
    }
  }

  template <class Start>
  c10::intrusive_ptr<c10d::Work> run(const char* op, Start start) const {
    try {
      return start();
    } catch (...) {
      rethrow_as_error(op, rank(), options().peer_loss.get());
    }
  }

  [[nodiscard]] const detail::Skeleton& skeleton() const noexcept { return state_->skeleton; }

  void check_point_to_point(const char* op, const at::Tensor& t, int peer, int tag) const {
    detail::check_buffer(op, rank(), t);
    skeleton().check_peer(op, peer);
    if (peer == rank()) skeleton().fail(op, "rank " + std::to_string(peer) + " is this rank; Gloo cannot send to itself");
    if (tag < 0) skeleton().fail(op, "tag " + std::to_string(tag) + " is negative; Gloo tags count up from 0");
  }

  void receive(at::Tensor& t, int peer, int tag) {
    std::vector<at::Tensor> v{t};
    wait_for("recv", run("recv", [&] { return group().recv(v, peer, tag); }));
  }

  // The dtype Gloo reduces a tensor of dtype t in: Note [What Gloo lacks in LibTorch 1.13].
  static at::ScalarType reduced_type(const at::Tensor& t) noexcept {
    return t.scalar_type() == at::kBFloat16 ? at::kFloat : t.scalar_type();
  }
  // The same memory as a dtype Gloo moves: bfloat16 as float16, bit for bit.
  static at::Tensor bits(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? t.view(at::kHalf) : t; }

  static c10d::AllreduceOptions all_reduce_options(reduce_op op) {
    c10d::AllreduceOptions o;
    o.reduceOp = op == reduce_op::max ? c10d::ReduceOp::MAX : op == reduce_op::min ? c10d::ReduceOp::MIN
                                                                                    : c10d::ReduceOp::SUM;
    return o;
  }

  Request start_all_reduce(const char* op, at::Tensor& t, reduce_op r) {
    detail::check_reduction(op, rank(), t, r);
    auto watch = begin(op, t, static_cast<int>(r));
    const auto wire = t.scalar_type() == reduced_type(t) ? t : t.to(reduced_type(t));
    auto request = this->request(op, {t, wire});
    request.watch_ = std::move(watch);
    std::vector<at::Tensor> v{wire};
    request.native_.works.push_back(run(op, [&] { return group().allreduce(v, all_reduce_options(r)); }));
    const bool average = r == reduce_op::average, converted = !wire.is_same(t);
    if (average || converted)
      request.then_ = [t, wire, average, converted, n = size()]() mutable {
        if (average) wire.div_(n);
        if (converted) t.copy_(wire);
      };
    return request;
  }

  // Every collective passes the skeleton's preamble: validation, ledger, fingerprint and
  // watch (comm/detail/skeleton.hpp).
  [[nodiscard]] detail::Watch begin(std::string_view op, const at::Tensor& t, int detail) {
    return skeleton().begin(op, t, detail, Words{*this});
  }

  // The skeleton's word collectives: blocking c10d calls.
  struct Words {
    const Gloo& comm;
    void all_reduce_max(const char* op, at::Tensor& w) const {
      std::vector<at::Tensor> v{w};
      comm.wait_for(op, comm.run(op, [&] { return comm.group().allreduce(v, all_reduce_options(reduce_op::max)); }));
    }
    void all_gather(const char* op, const at::Tensor& in, at::Tensor& out) const {
      const auto n = in.numel();
      std::vector<std::vector<at::Tensor>> parts(1);
      for (int i = 0; i < comm.size(); ++i) parts[0].push_back(out.narrow(0, i * n, n));
      std::vector<at::Tensor> v{in};
      comm.wait_for(op, comm.run(op, [&] { return comm.group().allgather(parts, v); }));
    }
  };

  // A blocking wait, as a request's: Handles::wait (a recoverable group's too).
  void wait_for(const char* op, const c10::intrusive_ptr<c10d::Work>& work) const {
    Handles h;
    h.works.push_back(work);
    h.loss = options().peer_loss;
    h.limit = options().timeout;
    h.wait(op, rank());
  }

  std::shared_ptr<State> state_;
};

}  // namespace paratrain::comm
