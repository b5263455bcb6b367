#pragma once
/// \file
/// paratrain::error — the one exception type the library throws.

#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace paratrain {

/// Thrown for misuse and for failures of the underlying engines (MPI, NCCL, c10d).
///
/// `what()` reads "paratrain: <operation> on rank <r>: <message>", so a log that
/// interleaves several ranks still says who failed, doing what, and (in the message)
/// how to fix it. `rank()` is -1 where no rank is known yet (before MPI starts).
class error : public std::runtime_error {
 public:
  error(std::string_view operation, int rank, std::string_view message)
      : std::runtime_error(format(operation, rank, message)), operation_(operation), rank_(rank) {}

  [[nodiscard]] const std::string& operation() const noexcept { return operation_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  static std::string format(std::string_view operation, int rank, std::string_view message) {
    std::string s = "paratrain: ";
    s += operation;
    if (rank >= 0) {
      s += " on rank ";
      s += std::to_string(rank);
    }
    s += ": ";
    s += message;
    return s;
  }

  std::string operation_;
  int rank_;
};

/// Thrown by a communicator built to survive a lost rank (elastic::Membership's): a peer
/// died or stopped answering, or another rank said so. The group is then unusable; the
/// survivors meet again without the lost rank (docs/elastic.md, Note [Recoverable groups]).
class peer_lost : public error {
 public:
  using error::error;
};

namespace detail {

/// Throws error(operation, rank, message()) from a function kept out of its caller's hot
/// path: a check's message is built only when the check fails, out of line, and the check
/// itself stays a compare and a branch in the caller (a communicator checks its arguments
/// on every call).
template <class Message>
[[noreturn, gnu::cold, gnu::noinline]] void fail_with(std::string_view operation, int rank, Message&& message) {
  throw error(operation, rank, std::forward<Message>(message)());
}

}  // namespace detail

}  // namespace paratrain
